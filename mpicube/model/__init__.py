"""The model (GPT-2, Llama, Mixtral), written once against the layout
protocol and the family protocol.

``gpt`` holds the embedding and the tied head and strings the blocks of
``block`` (one pre-norm transformer block) together, forward and
backward, whole or as a pipeline chunk; it never asks which layout it
runs on (it calls the layout's linears, norms and reductions) nor which
family (``families``: one object per family, chosen once from the
configuration, supplies the parameter list, norms, attention branch and
MLP, built from ``attention``, ``mlp``, ``rotary`` and ``moe``).
``dropout`` draws the masks at global indices; ``tape`` names what
each module keeps for backward; ``kvcache`` holds generation's
per-layer keys and values.

May import: ``core``, ``device``, ``ops``, ``parallel``.
"""
