"""``python -m mpicube.check A.h5 B.h5``: compare two traces without MPI (report.main)."""

import sys

from .report import main

sys.exit(main())
