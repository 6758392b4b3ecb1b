"""The GPT-2 model, written once against the layout protocol.

``gpt`` holds the embedding, the blocks and the tied head with their
forward and backward passes; it never asks which layout it runs on, it
calls the layout's linears, LayerNorms and reductions. ``kvcache`` holds
generation's per-layer keys and values.

May import: ``core``, ``device``, ``ops``, ``parallel``.
"""
