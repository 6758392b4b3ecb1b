"""``--help`` in sections a person can scan: click lists a command's options
in one flat block (train's ran to 171 lines), so ``SectionedCommand``
prints them under headings instead, in the order the sections are named,
and an option no section names under "Other options" (tests/test_help.py
fails on any such option of train, so a new option is given a home).
"""

from __future__ import annotations

import click

from ..core.config import DEEPSEEK_OPTIONS

# (heading, option names as click calls them) for train and trace, in the order a run is set up.
TRAIN_SECTIONS = (
    ("Model", ("arch", "n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "n_kv_head", "ffn_hidden",
               "rope_theta", "rms_eps", "tie_embeddings", "n_experts", "top_k", "no_norm_topk", "capacity_factor",
               "router_aux_loss_coef", "router_z_loss_coef") + DEEPSEEK_OPTIONS + ("q_lora_rank", "kv_lora_rank",
               "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "mtp_depth",
               "mtp_loss_weight", "dropout")),
    ("Parallelism", ("layout", "dp", "depth", "ep", "pp", "pp_schedule", "virtual_stages", "cp",
                     "cp_kind", "ulysses", "sequence_parallel", "zero", "hsdp", "recompute")),
    ("Optimisation", ("batch_size", "grad_accum", "steps", "lr", "warmup", "weight_decay", "grad_clip",
                      "optimizer", "muon_qkv", "seed")),
    ("Data and checkpoints", ("config", "data", "val_data", "out", "init_from", "resume", "ckpt_every", "keep",
                              "stop_after", "time_limit", "force_unlock", "eval_every", "eval_batches",
                              "max_bytes", "sharded", "run_dir")),
    ("Numerics", ("dtype", "device", "tf32", "loss_scale", "loss_scale_growth_interval", "loss_scale_backoff",
                  "fp8", "fp8_grad_format", "fp8_accumulate", "fp8_amax_history", "fp8_amax_rule", "fp8_block",
                  "fp8_pow2")),
    ("Diagnostics", ("log_every", "profile", "collective_timeout", "help")),
)

TRAIN_EPILOG = """\b
The usual workflow:
  mpicube train --steps 200 --out runs/a                 one process, the serial model
  mpiexec -n 8 mpicube train --layout 3d --out runs/c    a 2x2x2 cube of ranks
  mpicube train --steps 200 --out runs/a --resume        continue after a stop (exit status 75)
  mpicube eval runs/a                                    validation loss of its last checkpoint
  mpicube generate runs/a --prompt "def main("           text from it
  mpicube plot runs/a runs/c --out loss.png              their loss curves, overlaid
Every option, exit statuses and the run directory: docs/options.md."""


class SectionedCommand(click.Command):
    """A click command whose ``--help`` lists its options in ``sections``."""

    def __init__(self, *args, sections=TRAIN_SECTIONS, **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx, formatter) -> None:
        records = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                records[_name(param)] = record
        placed = set()
        for heading, names in self.sections:
            rows = [records[n] for n in names if n in records]
            placed.update(n for n in names if n in records)
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)
        rest = [record for name, record in records.items() if name not in placed]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)

    def unplaced(self, ctx) -> list:
        """Options no section names (for tests/test_help.py)."""
        named = {n for _, names in self.sections for n in names}
        return [_name(p) for p in self.get_params(ctx) if p.get_help_record(ctx) is not None and _name(p) not in named]


def _name(param) -> str:
    """The parameter's name; "help" for click's own help option (whose
    name differs between click versions)."""
    return "help" if "--help" in getattr(param, "opts", ()) else param.name
