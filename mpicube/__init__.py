"""mpicube: tensor-parallel GPT training in pure array code over MPI.

One subpackage per layer, bottom to top (docs/design.md section 1); a layer
imports only the layers below it (tests/test_architecture.py keeps it so):

    core      errors, the model's sizes, integer helpers, the console
    device    array namespace, number formats, kernels (numba, CUDA, cuBLAS)
    ops       local forward/backward pairs, the counter-based generator
    parallel  comm (all MPI), grid and axes, layouts, parameter store, ZeRO
    model     the GPT written once, the KV cache
    files     checkpoints, model formats, token data, tokenizers
    check     the trace format, compare, recording another framework (numpy, h5py)
    training  the trainer and its step, options, optimizer, run directory
    analysis  cost model, bench, trace
    cli       the commands, generation

This file itself imports nothing of mpicube, so any layer may read
``__version__``.
"""

import os

__version__ = "0.1.0"

# OpenBLAS's idle worker threads spin for 2^n cycles after each GEMM before
# they sleep. Waking a sleeping worker costs more than a small GEMM takes
# (the 144-wide model's step ran 43 ms with 2^16, its workers asleep
# between most GEMMs, and 36 ms with 2^24, about 6 ms at 2.6 GHz, which
# bridges the gaps between the GEMMs of a step). The fused kernels between
# them run on the calling thread at such sizes (device/fused.py), so the
# spinning takes nothing from them. OpenBLAS reads this when NumPy loads
# it, so it only takes effect when mpicube is imported first (the command
# line always is); a value already set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")
