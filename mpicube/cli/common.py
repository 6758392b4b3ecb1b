"""What the commands share: the ``mpicube`` group, the model's options
several commands take, rank 0's ``echo`` and the MPI world they run in.
How ranks share the model is said by ``cli.parallel_options``, the number
formats by ``cli.precision_options``.

The commands live in ``cli.train`` (train, eval, prepare, trace) and
``cli.model`` (info, bench, inspect, convert, generate, compare); each
registers itself on ``cli`` from here. ``cli.main`` imports them all and
runs the group under the error handling every command shares.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import click

from .. import __version__
from ..core.config import BIAS_UPDATES, DEEPSEEK_OPTIONS, ROUTERS
from ..core.config import family_fields  # noqa: F401 (the family options' meaning, for the commands)
from .latent_options import MLA_OPTIONS, mla_options  # noqa: F401 (deepseek_v3's, apart for length)

try:                                    # Python >= 3.11
    import tomllib
except ModuleNotFoundError:             # pragma: no cover - older Pythons
    import tomli as tomllib

LAYOUT_CHOICES = ("auto", "serial", "1d", "2d", "2.5d", "3d")

# --seed: NumPy's generators take any non-negative integer; -1 would be a traceback at the first batch
SEED = click.IntRange(0, 2 ** 64 - 1)

_mpi = {"world": None, "errors": None}   # COMM_WORLD and a private duplicate for error agreement


# --------------------------------------------------------------------------- small helpers


def env_settings(environ=os.environ) -> dict:
    """The plan's choices that the environment makes, read here and only
    here (every command passes them into its Plan, so nothing below the
    command line reads the environment and two plans with different
    settings can live in one process):

    * ``overlap``: collectives overlapped with GEMMs unless MPICUBE_OVERLAP=0
      (the blocking path stays, to measure what overlap hides and to check
      it bit for bit);
    * ``attention``: "full" (the op that holds the (T, T) scores) under
      MPICUBE_ATTENTION=full, else "blocks" (blockwise attention)."""
    return {"overlap": environ.get("MPICUBE_OVERLAP", "1") != "0",
            "attention": "full" if environ.get("MPICUBE_ATTENTION", "blocks") == "full" else "blocks"}


def _rank() -> int:
    world = _mpi["world"]
    return 0 if world is None else world.Get_rank()


def echo(text: str = "", err: bool = False) -> None:
    """Print on rank 0 only."""
    if _rank() == 0:
        click.echo(text, err=err)


class Duration(click.ParamType):
    """Seconds, or [[H:]M:]S like a batch system's time limit."""

    name = "seconds"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        try:
            parts = [float(p) for p in str(value).split(":")]
        except ValueError:
            self.fail(f"{value!r} is not a number of seconds or [[H:]M:]S", param, ctx)
        if len(parts) > 3:
            self.fail(f"{value!r} has too many ':' fields (use [[H:]M:]S)", param, ctx)
        seconds = 0.0
        for p in parts:
            seconds = seconds * 60 + p
        return seconds


def _load_config(ctx, param, path):
    """``--config FILE.toml``: its keys (option names, dashes or underscores)
    become defaults, so options given on the command line override them.
    Each value must already have its option's type (``_config_value``), and
    an option may be named once."""
    if path is None:
        return None
    if os.path.exists(path) and not os.path.isfile(path):      # a FIFO would block the read forever
        raise click.BadParameter(f"{path}: not a regular file", ctx, param)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})", ctx, param) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise click.BadParameter(f"{path}: not valid TOML ({exc})", ctx, param) from None
    options = {p.name: p for p in ctx.command.params if p.expose_value}
    values, given_as = {}, {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in options or isinstance(value, dict):
            raise click.BadParameter(f"{path}: unknown key {key!r}; valid keys are option names such as "
                                     f"{', '.join(sorted(options)[:6])}, ...", ctx, param)
        if name in given_as:
            raise click.BadParameter(f"{path}: {given_as[name]!r} and {key!r} are the same option "
                                     f"(--{name.replace('_', '-')}); give it once", ctx, param)
        given_as[name] = key
        values[name] = _config_value(options[name], key, value, path, ctx, param)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def _config_value(option, key, value, path, ctx, param):
    """``value`` if TOML gave it the type ``option`` takes, else a one-line
    BadParameter. Nothing is converted: click would read ``n-embd = 32.7``
    as 32 and ``steps = true`` as 1, silently; a list is refused by name."""
    kind = option.type
    if isinstance(value, list):
        problem = f"a list, and {key} takes one value"
    elif isinstance(kind, click.Choice) and isinstance(value, int) and str(value) in kind.choices:
        return str(value)               # zero = 1 for --zero's choice "1"
    elif option.is_flag or isinstance(kind, click.types.BoolParamType):
        problem = None if isinstance(value, bool) else "expected true or false"
    elif isinstance(kind, click.types.IntParamType):
        problem = None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    elif isinstance(kind, click.types.FloatParamType):
        problem = None if isinstance(value, (int, float)) and not isinstance(value, bool) else "expected a number"
    elif isinstance(kind, (click.Choice, click.types.StringParamType, click.Path)):
        problem = None if isinstance(value, str) else "expected a string (in quotes)"
    else:                               # Duration: seconds or "[[H:]M:]S"
        problem = None if isinstance(value, (int, float, str)) and not isinstance(value, bool) else \
            "expected a number or a string"
    if problem is None:
        return value
    shown = repr(value) if isinstance(value, (list, str)) else str(value).lower() if isinstance(value, bool) \
        else str(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise click.BadParameter(f"{path}: {key} = {shown}: {problem} (TOML values are taken as written, "
                             "not converted)", ctx, param)


def model_options(f):
    """The model's shape, shared by ``train`` and ``info``."""
    f = click.option("--seq-len", type=int, default=64, show_default=True,
                     help="sequence length T, also the model's context n_ctx")(f)
    f = click.option("--n-embd", type=int, default=144, show_default=True, help="hidden size h")(f)
    f = click.option("--n-head", type=int, default=12, show_default=True, help="attention heads")(f)
    f = click.option("--n-layer", type=int, default=4, show_default=True, help="transformer blocks")(f)
    return f


def arch_options(f):
    """The model family and Llama's settings (train, bench, trace): each
    Llama option is refused under --arch gpt2 (``core.config.family_fields``)."""
    f = moe_options(f)
    f = mla_options(f)
    f = click.option("--tie-embeddings", is_flag=True, default=False,
                     help="llama: the LM head is the token embedding (GPT-2's always is)")(f)
    f = click.option("--rms-eps", type=float, default=None, help="llama: RMSNorm epsilon  [default: 1e-6]")(f)
    f = click.option("--rope-theta", type=float, default=None,
                     help="llama: rotary embedding base  [default: 10000]")(f)
    f = click.option("--ffn-hidden", type=int, default=None,
                     help="llama: SwiGLU hidden width  [default: 8h/3 rounded up to a multiple of 256]")(f)
    f = click.option("--n-kv-head", type=int, default=None,
                     help="llama: key/value heads, dividing --n-head (grouped-query attention)  "
                          "[default: --n-head]")(f)
    f = click.option("--arch", type=click.Choice(("gpt2", "llama", "mixtral", "deepseek_v3")), default="gpt2",
                     show_default=True,
                     help="model family: gpt2; llama (RMSNorm, rotary positions, SwiGLU, "
                          "grouped-query attention, untied head, no biases); mixtral: Llama with a mixture of "
                          "experts (--n-experts 8 --top-k 2 unless given); deepseek_v3: Llama with multi-head "
                          "latent attention, and DeepSeekMoE with --n-routed-experts; with --init-from or --resume: "
                          "the file's family")(f)
    return f


def moe_options(f):
    """A mixture of experts in Llama's MLP place (docs/moe.md)."""
    f = deepseek_moe_options(f)
    f = click.option("--router-z-loss-coef", type=float, default=None,
                     help="moe: weight of the router z-loss  [default: 0]")(f)
    f = click.option("--router-aux-loss-coef", type=float, default=None,
                     help="moe: weight of the load-balancing loss  [default: 0.02, Mixtral's]")(f)
    f = click.option("--capacity-factor", type=float, default=None,
                     help="moe: at most ceil(F K N / E) tokens per expert, later ones dropped  "
                          "[default: dropless]")(f)
    f = click.option("--no-norm-topk", is_flag=True, default=False,
                     help="moe: weight experts by their probabilities as they are (Mixtral renormalises the top k)")(f)
    f = click.option("--top-k", type=int, default=None, help="moe: experts per token  [default: 2]")(f)
    f = click.option("--n-experts", "--n-routed-experts", "n_experts", type=int, default=None,
                     help="llama: a mixture of this many SwiGLU experts in each block's MLP place  "
                          "[default: none; 8 under --arch mixtral]")(f)
    return f


def deepseek_moe_options(f):
    """DeepSeekMoE's options of the mixture (docs/moe.md, "DeepSeekMoE"), for any family with experts."""
    f = click.option("--seq-aux-loss-coef", type=float, default=None,
                     help="moe, sigmoid router: weight of the sequence-wise auxiliary loss  [default: 0]")(f)
    f = click.option("--bias-update", type=click.Choice(BIAS_UPDATES), default=None,
                     help="moe, sigmoid router: plain: bias += rate sign(mean load - load), the DeepSeek-V3 "
                          "report's rule; centred: that update less its mean (torchtitan)  [default: plain]")(f)
    f = click.option("--bias-update-rate", type=float, default=None,
                     help="moe, sigmoid router: the aux-loss-free bias's step after each optimizer step, from "
                          "the loads of the whole global batch  [default: 0, the bias stays]")(f)
    f = click.option("--first-k-dense", type=int, default=None,
                     help="moe: the first k blocks keep the dense SwiGLU MLP  [default: 0]")(f)
    f = click.option("--moe-ffn-hidden", type=int, default=None,
                     help="moe: each expert's SwiGLU width  [default: --ffn-hidden]")(f)
    f = click.option("--n-shared-experts", type=int, default=None,
                     help="moe: always-on experts, one SwiGLU of width n x --moe-ffn-hidden added to the "
                          "routed output  [default: 0]")(f)
    f = click.option("--routed-scaling-factor", type=float, default=None,
                     help="moe, sigmoid router: the routed experts' weights times this  [default: 1]")(f)
    f = click.option("--topk-groups", type=int, default=None,
                     help="moe, sigmoid router: the groups a token's experts come from (a group's score: "
                          "the sum of its two best)  [default: --n-groups]")(f)
    f = click.option("--n-groups", type=int, default=None,
                     help="moe, sigmoid router: expert groups for group-limited routing  [default: 1]")(f)
    f = click.option("--router", type=click.Choice(ROUTERS), default=None,
                     help="moe: softmax: Mixtral's top-k of the softmax; sigmoid: DeepSeek-V3's sigmoid "
                          "scores, top-k on score + a balancing bias  [default: softmax]")(f)
    return f


MOE_OPTIONS = ("n_experts", "top_k", "no_norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef"
               ) + DEEPSEEK_OPTIONS
ARCH_OPTIONS = ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "rms_eps", "tie_embeddings") + MOE_OPTIONS + MLA_OPTIONS


class StepRange(click.ParamType):
    """``START:STOP``, 1 <= START <= STOP: the steps START to STOP, both
    included (one step: ``N`` or ``N:N``)."""

    name = "START:STOP"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            parts = [int(p) for p in str(value).split(":")]
        except ValueError:
            parts = []
        parts = parts * 2 if len(parts) == 1 else parts
        if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
            self.fail(f"{value!r} is not START:STOP with 1 <= START <= STOP (e.g. 2:4: steps 2 to 4)", param, ctx)
        return parts[0], parts[1]


def profile_option(help_text: str):
    """``--profile START:STOP`` (train, bench): a per-rank timeline of those steps (analysis.profile)."""
    return click.option("--profile", type=StepRange(), default=None,
                        help="record a timeline of compute and communication on every rank for " + help_text)


def collective_timeout_option(f):
    """``--collective-timeout SECONDS``: every command that communicates
    (train, eval, bench) runs under the watchdog (``parallel.watchdog``)."""
    def check(ctx, param, value):
        if value < 0:
            raise click.BadParameter(f"{value:g} must be 0 (off) or a number of seconds", ctx, param)
        return value

    return click.option("--collective-timeout", type=Duration(), default=600, show_default=True, callback=check,
                        metavar="SECONDS",
                        help="abort the job (exit status 76) when a collective waits, or a step makes no "
                             "progress, this long: a rank stopped, died or was cut off; 0 = never")(f)


@contextmanager
def watched(timeout: float, phase: str):
    """The command's body under the watchdog (collective over the world)."""
    from ..parallel.watchdog import watching

    with watching(_mpi["world"], timeout, phase):
        yield


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mpicube")
def cli():
    """GPT-2, Llama, Mixtral and DeepSeek-V3 training with 1-D, 2-D, 2.5-D and 3-D tensor parallelism, in NumPy/CuPy over MPI.

    Run under MPI: mpiexec -n 8 mpicube train --layout 3d
    """
