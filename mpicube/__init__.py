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

__version__ = "0.1.0"
