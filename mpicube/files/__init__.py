"""Files: what mpicube reads and writes, as tensors by name and shape.

``checkpoint`` (format version 1: HDF5 virtual datasets over per-rank
shards), ``formats`` (Hugging Face and llm.c model files, and the
detection that lets every command read all three), ``data`` (llm.c token
shards and the built-in corpus), ``tokenizers`` and ``atomic`` (write,
then rename). Nothing here builds a model or a layout; it hands tensors to
the layers that do.

May import: ``core``, ``device``, ``ops``, ``parallel``, ``model``.
"""
