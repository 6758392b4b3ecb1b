"""Check: mpicube's trace format on its own, for checking a framework.

Everything another implementation needs to be compared with mpicube, and
nothing that needs MPI, CuPy or a model: ``names`` (the tensors a trace
holds, in the order the computation makes them, and how deep in the
computation each one is), ``tracefile`` (opening a trace and telling what
is wrong with a file that is not one), ``tolerance`` (the per-dtype
budgets and the depth-aware bound), ``compare`` and ``report`` (tensor by
tensor, failing closed: ``mpicube compare`` is these modules, and
``python -m mpicube.check`` runs them without MPI), ``reference`` (a
reference trace's config, optimizer, initial parameters, batches and
masks), ``writer`` (a trace from plain numpy arrays), ``shards`` (a
tensor as each rank's blocks with their global index, replicas checked),
``placements`` (each block's placement on the mesh: replicated, split,
a pending sum), ``diagnose`` and ``precision`` (what a disagreeing
tensor's values say: a pending sum consumed as replicated, an update
never applied, mixed precision off) and ``envelope`` (tolerances measured
from reruns at the candidate's precision).
``namemaps`` turns another codebase's parameter names and layouts into the
trace's, and ``torch`` records a ``torch.nn.Module`` with them; torch is
imported there only, and only when it is used (an optional extra: mpicube
itself never needs it).

Why a layer of its own: a framework user should be able to
``import mpicube.check`` with numpy and h5py alone, so the format and the
checker must not sit beside modules that import the parallel machinery.
It sits above ``files`` (a trace is a file mpicube writes) and below
``training`` and ``analysis``, whose ``trace`` writes the format defined here.

May import: ``core`` only (numpy and h5py from outside; torch in ``torch``
alone). tests/test_check.py checks that importing it loads no MPI.
"""
