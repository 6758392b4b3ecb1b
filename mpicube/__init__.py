"""mpicube: tensor-parallel GPT training in pure array code over MPI.

Layers, bottom to top (DESIGN.md section 1): backend, comm, grid, layouts,
ops, model, optim/data/checkpoint, train/cli.
"""

import os

__version__ = "0.1.0"

# OpenBLAS's idle worker threads spin for 2^28 cycles (about 0.1 s) after
# each GEMM before they sleep, holding the cores that the fused kernels
# (mpicube.fused) want between two GEMMs. 2^16 cycles still bridges the
# gaps between the small GEMMs of one batched matmul. OpenBLAS reads this
# when NumPy loads it, so it only takes effect when mpicube is imported
# first (the command line always is); a value already set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
