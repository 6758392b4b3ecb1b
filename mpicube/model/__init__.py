"""The GPT-2 model, written once against the layout protocol.

``gpt`` holds the embedding and the tied head and strings the blocks of
``block`` (one transformer block, and the dropout masks at global
indices) together, forward and backward, whole or as a pipeline chunk; it
never asks which layout it runs on, it calls the layout's linears,
LayerNorms and reductions. ``kvcache`` holds
generation's per-layer keys and values.

May import: ``core``, ``device``, ``ops``, ``parallel``.
"""
