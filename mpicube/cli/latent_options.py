"""deepseek_v3's own command-line options (multi-head latent attention,
multi-token prediction), apart from ``cli.common`` for its length; their
meaning and checks are ``core.config.family_fields``'."""

import click


def mla_options(f):
    """deepseek_v3's multi-head latent attention (ops/mla.py)."""
    f = click.option("--rope-interleave/--no-rope-interleave", default=None,
                     help="deepseek_v3: the rotary columns come in interleaved pairs, as DeepSeek's "
                          "checkpoints  [default: interleaved]")(f)
    f = click.option("--v-head-dim", type=int, default=None, help="deepseek_v3: value width of a head  [default: 16]")(f)
    f = click.option("--qk-nope-head-dim", type=int, default=None,
                     help="deepseek_v3: non-rotary query/key width of a head  [default: 16]")(f)
    f = click.option("--qk-rope-head-dim", type=int, default=None,
                     help="deepseek_v3: rotary key width, shared by every head  [default: 8]")(f)
    f = click.option("--kv-lora-rank", type=int, default=None, help="deepseek_v3: the kv latent's rank  [default: 32]")(f)
    f = click.option("--q-lora-rank", type=int, default=None,
                     help="deepseek_v3: the q latent's rank, 0: no q compression  [default: 0]")(f)
    f = click.option("--mtp-loss-weight", type=float, default=None,
                     help="deepseek_v3: the MTP losses' weight W: loss = main + W / D x their sum  [default: 0.3]")(f)
    f = click.option("--mtp-depth", type=int, default=None,
                     help="deepseek_v3: multi-token prediction depths D (a block each, sharing the "
                          "embedding and head)  [default: 0]")(f)
    return f


MLA_OPTIONS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
               "mtp_depth", "mtp_loss_weight")
