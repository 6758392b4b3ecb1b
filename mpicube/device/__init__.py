"""The device: where arrays live and which kernels compute on them.

The array namespace and device selection by node-local rank (``backend``),
number formats and the GEMM each format uses (``precision``, with the
cuBLAS call in ``cublas_gemm``), the kernel choice (``kernels``) between
numba's CPU kernels (``fused``) and CuPy's (``cuda_kernels``, source in
``cuda_source``), thread shares per rank (``threads``) and pinned host
buffers for MPI (``staging``). Nothing here communicates or knows a model.

May import: ``core``.
"""
