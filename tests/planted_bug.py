"""The mpicube command line with one bug planted from outside the package
(tests/test_trace.py): a trace must name the first tensor it corrupts.

    mpiexec -n 8 python tests/planted_bug.py h.1.mlp.c_fc trace --layout 3d ...

The named 3-D linear reduce-scatters its output over the input's row axis
(``b = a``) instead of the other one: the shapes still fit, the sums are
wrong. The package itself carries no test hook for this.
"""

import sys

from mpicube.parallel.layouts import cube

WRONG = sys.argv.pop(1)          # the linear's parameter prefix, e.g. h.1.mlp.c_fc
_init = cube.CubeLinear.__init__


def _planted(self, store, prefix, a, b, **kwargs):
    _init(self, store, prefix, a=a, b=a if prefix == WRONG else b, **kwargs)


cube.CubeLinear.__init__ = _planted

if __name__ == "__main__":
    from mpicube.cli.main import main

    main(sys.argv[1:])
