"""mpicube: tensor-parallel GPT training in pure array code over MPI.

One subpackage per layer, bottom to top (DESIGN.md section 1); a layer
imports only the layers below it (tests/test_architecture.py keeps it so):

    core      errors, the model's sizes, integer helpers, the console
    device    array namespace, number formats, kernels (numba, CUDA, cuBLAS)
    ops       local forward/backward pairs, the counter-based generator
    parallel  comm (all MPI), grid and axes, layouts, parameter store, ZeRO
    model     the GPT written once, the KV cache
    files     checkpoints, model formats, token data, tokenizers
    training  the trainer and its step, options, optimizer, run directory
    analysis  cost model, bench, trace, compare
    cli       the commands, generation

This file itself imports nothing of mpicube, so any layer may read
``__version__``.
"""

import os

__version__ = "0.1.0"

# OpenBLAS's idle worker threads spin for 2^28 cycles (about 0.1 s) after
# each GEMM before they sleep, holding the cores that the fused kernels
# (mpicube.device.fused) want between two GEMMs. 2^16 cycles still bridges the
# gaps between the small GEMMs of one batched matmul. OpenBLAS reads this
# when NumPy loads it, so it only takes effect when mpicube is imported
# first (the command line always is); a value already set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
