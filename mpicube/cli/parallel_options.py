"""The options that say how a command's ranks share the model: the
tensor-parallel layout and dp, expert parallelism, the pipeline, sequence
and context parallelism, recompute, ZeRO and accumulation (train, eval,
bench, trace, info and generate take the ones they use). Each decorator
adds its options; what they mean is checked in ``parallel.planning``
and ``training.options``."""

from __future__ import annotations

import click

from .common import LAYOUT_CHOICES

RECOMPUTE_CHOICES = ("none", "gathers", "blocks")   # layouts/base.py RECOMPUTE_MODES
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")  # schedules.ALL_SCHEDULES


def layout_options(f):
    f = click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")(f)
    f = click.option("--dp", type=int, default=1, show_default=True,
                     help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")(f)
    f = click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default="auto", show_default=True,
                     help="tensor-parallel scheme; auto: 2.5d with --depth, else 3d on a cube, 2d on a "
                          "square, 1d otherwise")(f)
    return f


def ep_option(f):
    """``--ep`` (train, eval): a mixture of experts' expert-parallel ranks, taken from --dp (docs/moe.md)."""
    return click.option("--ep", type=int, default=1, show_default=True,
                        help="moe: expert-parallel ranks taken from the --dp replicas; each holds E/ep experts")(f)


def pipeline_options(f):
    """``--pp``, ``--pp-schedule`` and ``--virtual-stages`` (train, eval,
    bench, trace, generate): pipeline stages around the tensor-parallel layout."""
    f = click.option("--virtual-stages", type=int, default=1, show_default=True,
                     help="model chunks per stage: interleaved's V (pp x V divides n_layer); 2 for zbv, dualpipev")(f)
    f = click.option("--pp-schedule", type=click.Choice(SCHEDULE_CHOICES), default="1f1b", show_default=True,
                     help="schedule over the --grad-accum micro-batches (zero-bubble: zb-h1, zbv, dualpipev)")(f)
    f = click.option("--pp", type=int, default=1, show_default=True,
                     help="pipeline stages; the world splits into dp x pp x tensor-parallel ranks")(f)
    return f


def sequence_parallel_option(f):
    """``--sequence-parallel`` (train, eval, bench, trace, info): 1-D's
    canonical form sharded along the sequence (parallel/layouts/seqpar.py)."""
    return click.option("--sequence-parallel", is_flag=True, default=False,
                        help="1d layout: LayerNorm, dropout and residual regions hold T/tp positions of every "
                             "sequence; each all-reduce becomes an all-gather + reduce-scatter (same bytes, "
                             "1/tp of those activations)")(f)


def cp_option(f):
    """``--cp C`` (train, eval, bench): context-parallel ranks (parallel/context.py)."""
    return click.option("--cp", type=int, default=1, show_default=True,
                        help="context-parallel ranks: each sequence cut into 2C chunks, rank r holding chunks r "
                             "and 2C-1-r, attention by a ring passing K and V; the world splits into "
                             "dp x cp x tensor-parallel ranks")(f)


def cp_kind_options(f):
    """``--cp-kind`` and ``--ulysses`` (train, eval, info): how the cp ranks share
    attention (parallel/context.py, parallel/ulysses.py)."""
    f = click.option("--ulysses", type=int, default=1, show_default=True,
                     help="--cp-kind hybrid: Ulysses group size U (consecutive cp ranks); the ring runs over "
                          "cp / U groups")(f)
    return click.option("--cp-kind", type=click.Choice(["ring", "ulysses", "hybrid"]), default="ring",
                        show_default=True,
                        help="ring: K/V passed round the cp ranks; ulysses: an all-to-all trades sequence shards "
                             "for head shards before attention and back after (cp must divide the heads); "
                             "hybrid: Ulysses inside groups of --ulysses ranks, the ring across them")(f)


def info_step_options(f):
    """``--optimizer`` and ``--hsdp`` as info prices them (train's own options)."""
    f = click.option("--hsdp", type=int, default=1, show_default=True,
                     help="with --zero 3: dp as R replicas of dp/R-way shard groups (as train --hsdp)")(f)
    return click.option("--optimizer", type=click.Choice(["adamw", "muon"]), default="adamw", show_default=True,
                        help="the optimizer step's traffic: muon gathers each hidden matrix over dp (ZeRO) and tp")(f)


def recompute_option(f):
    return click.option("--recompute", type=click.Choice(RECOMPUTE_CHOICES), default="none", show_default=True,
                        help="trade memory for communication and FLOPs: gathers = gather weight and activation "
                             "panels again in backward instead of keeping them; blocks = keep only each "
                             "block's input and rerun its forward in backward")(f)


def zero_option(help_text: str):
    """``--zero {0,1,2,3}`` as an int (train, bench, info; each says what it does there)."""
    return click.option("--zero", type=click.Choice(["0", "1", "2", "3"]), default="0", show_default=True,
                        callback=lambda ctx, param, value: int(value), help=help_text)


def grad_accum_option(help_text: str):
    """``--grad-accum N`` (train, bench, info; each says what it does there)."""
    return click.option("--grad-accum", type=int, default=1, show_default=True, help=help_text)


def sharing_options(f):
    """The layout, expert, pipeline, context and sequence options at once,
    in the order ``--help`` lists them (train and eval share the stack)."""
    for option in (sequence_parallel_option, cp_kind_options, cp_option, pipeline_options, ep_option,
                   layout_options):
        f = option(f)
    return f
