"""Local ops: the transformer's arithmetic on one rank's blocks, with no
communication of its own.

Forward/backward pairs for LayerNorm, GELU, Llama's RMSNorm, rotary
embeddings and SwiGLU (``llama``), causal attention, softmax
cross-entropy over a (possibly split) vocabulary and the token embedding
(``local``, ``vocab``), the counter-based generator behind initial
values and dropout masks (``rng``), FP8 quantization emulated exactly
(``fp8``: formats, amax, scales, rounding; ``fp8_recipes``: which group
and format each recipe gives each GEMM operand), and DeepSeek-V3's
pieces, used as submodules: multi-head latent attention (``mla``), its
router (``deepseek_router``), multi-token prediction (``mtp``) and YaRN's
rotary scaling (``yarn``). A sum over a dimension that a layout
may have split arrives as a callable (``allsum``, ``allmax``), so the same
op serves every layout. Each op runs on NumPy or CuPy arrays and lets the
device layer pick its kernels.

May import: ``core``, ``device``. Imported by the layouts, the model and
everything above them, as ``from mpicube import ops``: this face names the
ops of both modules.
"""

from .local import (_GELU_S, CACHE_ELEMS, attention_backward, attention_forward, batched_matmul,  # noqa: F401
                    block_rows, causal_bias, causal_softmax, causal_softmax_backward, column_dots, column_sums,
                    gelu_backward, gelu_forward, identity, keep_mask, layernorm_backward, layernorm_forward,
                    row_blocks, rowdot)
from .llama import (rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward,  # noqa: F401
                    rope_inv_freq, rope_tables, swiglu_backward, swiglu_forward)
from .vocab import (cross_entropy_backward, cross_entropy_forward, embedding_backward,  # noqa: F401
                    embedding_forward, scatter_add_rows)
