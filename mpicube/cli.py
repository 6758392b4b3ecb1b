"""The ``mpicube`` command line: train, eval, prepare, info, inspect, bench,
convert, generate.

Run it as ``mpiexec -n P mpicube train ...`` (or ``python -m mpicube``).

Errors (DESIGN.md section 7). Bad input - ``UserError`` (``ConfigError`` is
one), ``DataError``, ``CheckpointError``, a click usage error - is reported by
rank 0 as one line ``error: <message>`` on stderr, without a traceback, and
the job exits with status 2. Such an error is normally raised by every rank
at the same point (sizes are validated before any collective, and inputs
that only rank 0 reads are broadcast with their error); when it is raised by
only some ranks while others wait in a collective, the ranks that failed
wait ``MPICUBE_ERROR_GRACE`` seconds (default 3) for the rest, then print
their own message and abort the whole job. Any other exception prints its
traceback, each line prefixed with the rank, and aborts the job with status
1, so no rank is ever left waiting.

Exit statuses: 0 done (also after ``--stop-after``), 1 internal error,
2 bad input, 3 training diverged, 75 stopped by a signal or ``--time-limit``
with a checkpoint written (resume with ``--resume``), 130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import click

from . import __version__
from .errors import UserError

try:                                    # Python >= 3.11
    import tomllib
except ModuleNotFoundError:             # pragma: no cover - older Pythons
    import tomli as tomllib

LAYOUT_CHOICES = ("auto", "serial", "1d", "2d", "2.5d", "3d")
DTYPE_CHOICES = ("float32", "float64", "float16", "bfloat16")
RECOMPUTE_CHOICES = ("none", "gathers", "blocks")   # layouts/base.py RECOMPUTE_MODES
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ABORT_PAUSE = 1.0       # seconds between a rank's last words and MPI_Abort

_mpi = {"world": None, "errors": None}   # COMM_WORLD and a private duplicate for error agreement


# --------------------------------------------------------------------------- small helpers


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
    become defaults, so options given on the command line override them."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})", ctx, param) from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path}: not valid TOML ({exc})", ctx, param) from None
    known = {p.name for p in ctx.command.params if p.expose_value}
    values = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in known or isinstance(value, dict):
            raise click.BadParameter(f"{path}: unknown key {key!r}; valid keys are option names such as "
                                     f"{', '.join(sorted(known)[:6])}, ...", ctx, param)
        values[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def model_options(f):
    """The model's shape, shared by ``train`` and ``info``."""
    f = click.option("--seq-len", type=int, default=64, show_default=True,
                     help="sequence length T, also the model's context n_ctx")(f)
    f = click.option("--n-embd", type=int, default=144, show_default=True, help="hidden size h")(f)
    f = click.option("--n-head", type=int, default=12, show_default=True, help="attention heads")(f)
    f = click.option("--n-layer", type=int, default=4, show_default=True, help="transformer blocks")(f)
    return f


def layout_options(f):
    f = click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")(f)
    f = click.option("--dp", type=int, default=1, show_default=True,
                     help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")(f)
    f = click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default="auto", show_default=True,
                     help="tensor-parallel scheme; auto: 2.5d with --depth, else 3d on a cube, 2d on a "
                          "square, 1d otherwise")(f)
    return f


def recompute_option(f):
    return click.option("--recompute", type=click.Choice(RECOMPUTE_CHOICES), default="none", show_default=True,
                        help="trade memory for communication and FLOPs: gathers = gather weight and activation "
                             "panels again in backward instead of keeping them; blocks = keep only each "
                             "block's input and rerun its forward in backward")(f)


def device_options(f):
    f = click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
                     help="NumPy on CPUs or CuPy, one GPU per rank")(f)
    f = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
                     help="float64 verifies, float32 trains; float16 and bfloat16 train in mixed precision "
                          "(16-bit activations and communication, float32 master weights)")(f)
    f = click.option("--tf32", is_flag=True, default=False,
                     help="GPU: float32 GEMMs on tensor cores (TF32 inputs, float32 accumulation)")(f)
    return f


# --------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mpicube")
def cli():
    """GPT-2 training with 1-D, 2-D, 2.5-D and 3-D tensor parallelism, in NumPy/CuPy over MPI.

    Run under MPI: mpiexec -n 8 mpicube train --layout 3d
    """


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config, is_eager=True,
              expose_value=False, help="TOML file of option values (keys as option names); "
                                       "options on the command line override it")
@layout_options
@model_options
@click.option("--vocab-size", type=int, default=256, show_default=True,
              help="vocabulary (256: byte-level tokens; 50257: GPT-2's BPE); --init-from's model sets its own")
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that the layout accepts]")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="micro-batches per step: forward+backward on batch/N sequences at a time, one update")
@click.option("--steps", type=int, default=500, show_default=True, help="optimizer steps (LR schedule length)")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="peak learning rate")
@click.option("--warmup", type=int, default=20, show_default=True, help="linear warmup steps, then cosine decay")
@click.option("--weight-decay", type=float, default=0.1, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="global norm clip (0 = off)")
@click.option("--dropout", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=1337, show_default=True, help="initialisation, data order, dropout")
@device_options
@recompute_option
@click.option("--data", type=str, default=None, metavar="PATH",
              help="train token shard (its <stem>_val<suffix> sibling is the validation set); "
                   "default: the built-in corpus (the Python standard library's sources)")
@click.option("--val-data", type=str, default=None, metavar="PATH",
              help="validation token shard  [default: the --data shard's <stem>_val<suffix> sibling; "
                   "without one, validation is off]")
@click.option("--out", type=str, default=None, metavar="RUN_DIR", help="run directory  [default: runs/<timestamp>]")
@click.option("--ckpt-every", type=int, default=0, show_default=True,
              help="checkpoint every N steps (0 = only the final one)")
@click.option("--keep", type=int, default=3, show_default=True, help="checkpoints kept (0 = all)")
@click.option("--eval-every", type=int, default=0, show_default=True, help="validate every N steps (0 = off)")
@click.option("--eval-batches", type=int, default=8, show_default=True, help="batches per validation")
@click.option("--log-every", type=int, default=10, show_default=True, help="console line every N steps")
@click.option("--init-from", type=str, default=None, metavar="MODEL",
              help="model to take the parameters and shape from: a checkpoint (step dir, checkpoint.h5 or "
                   "run dir, saved on any layout), a Hugging Face GPT-2 directory or an llm.c model file; "
                   "this run starts its own schedule and AdamW moments (with --resume: unless the run "
                   "directory has a checkpoint of its own, which is continued instead)")
@click.option("--resume", is_flag=True, default=False,
              help="continue from the run directory's latest checkpoint (fresh start if it has none)")
@click.option("--force-unlock", is_flag=True, default=False,
              help="take over the run directory's lock from a job on another host (only if that job has ended)")
@click.option("--stop-after", type=int, default=None,
              help="stop after this step with a checkpoint (the schedule still follows --steps)")
@click.option("--time-limit", type=Duration(), default=None,
              help="wall-clock budget (seconds or [[H:]M:]S): checkpoint and exit 75 before it runs out")
@click.option("--loss-scale", type=float, default=None,
              help="float16: initial dynamic loss scale  [default: 65536]")
@click.option("--loss-scale-growth-interval", type=int, default=None,
              help="float16: steps without overflow before the scale doubles  [default: 2000]")
@click.option("--loss-scale-backoff", type=float, default=None,
              help="float16: factor on the scale after an overflow (the step is skipped)  [default: 0.5]")
@click.option("--zero", type=click.Choice(["0", "1"]), default="0", show_default=True,
              callback=lambda ctx, param, value: int(value),
              help="1: shard the AdamW moments (and a 16-bit run's float32 master weights) over the --dp "
                   "replicas; gradients reduce-scattered, parameters all-gathered")
def train(**kwargs):
    """Train a GPT-2 model.

    Writes RUN_DIR/config.json, RUN_DIR/metrics.jsonl (one JSON object per
    step) and checkpoints in RUN_DIR/ckpt/. SIGTERM or SIGUSR1 on any rank
    (or --time-limit) writes a checkpoint and exits with status 75;
    `--resume` continues exactly where it stopped.
    """
    from .train import SHAPE_OPTIONS, TrainOptions
    from .train import train as run_training

    opts = TrainOptions(**kwargs)
    ctx = click.get_current_context()      # a model file decides the shape options nobody gave
    opts.given_shape = tuple(k for k in SHAPE_OPTIONS
                             if ctx.get_parameter_source(k) not in (click.core.ParameterSource.DEFAULT, None))
    return run_training(opts, _mpi["world"])


@cli.command("eval")
@click.argument("ckpt")
@click.option("--data", type=str, default=None, metavar="PATH",
              help="token shard to evaluate on  [default: the validation shard of the data the checkpoint "
                   "was trained on; the built-in corpus's for a model without one]")
@click.option("--batch-size", type=int, default=None,
              help="sequences per batch  [default: the checkpoint's training batch size]")
@click.option("--seq-len", type=int, default=None, help="sequence length  [default: the model's context]")
@click.option("--batches", type=int, default=8, show_default=True, help="evaluation batches (0 = all)")
@layout_options
@device_options
def eval_command(ckpt, data, batch_size, seq_len, batches, layout, dp, depth, dtype, device, tf32):
    """Mean cross-entropy of a model on a token shard.

    CKPT is a mpicube checkpoint, a Hugging Face GPT-2 directory or an
    llm.c model file.

    Batch k, row r starts at token (k*B + r)*T. The last line of stdout is a
    JSON object with "loss", "step" and "tokens".
    """
    from .evaluate import evaluate_checkpoint
    from .state import describe_layout

    result = evaluate_checkpoint(ckpt, data, batch_size, seq_len, batches, layout, dp, depth, dtype, device,
                                 _mpi["world"], tf32=tf32)
    if result.get("note"):
        echo(result["note"])
    if result.get("batch_note"):
        echo(f"{describe_layout(result['layout'])}, {result['batch_note']}")
    echo(f"{result['checkpoint']} (step {result['step']}): loss {result['loss']:.6f} over {result['batches']} "
         f"batches of {result['batch_size']} x {result['seq_len']} tokens")
    echo(json.dumps(result))


@cli.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", required=True, type=str, metavar="FILE", help="train shard to write, e.g. data/corpus.bin")
@click.option("--val-fraction", type=float, default=0.05, show_default=True,
              help="tail of the token stream that goes to <stem>_val<suffix>")
@click.option("--tokenizer", type=click.Choice(["bytes", "gpt2"]), default="bytes", show_default=True,
              help="bytes (vocabulary 256) or GPT-2's BPE through tiktoken (vocabulary 50257)")
def prepare(inputs, out, val_fraction, tokenizer):
    """Tokenize text files and folders into train/val shards (uint16 token ids)."""
    from . import data, tokenizers
    from .comm import on_root

    def run():
        encode = None if tokenizer == "bytes" else tokenizers.load(tokenizer).encode
        return [str(p) for p in data.prepare(list(inputs), out, val_fraction, encode)]

    paths = on_root(_mpi["world"], run)
    for path in paths:
        echo(f"wrote {path}: {len(data.read_shard(path)):,} tokens")


@cli.command()
@model_options
@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="also show this layout's sharding plan and cost predictions")
@click.option("-n", "--world-size", type=int, default=None, help="number of ranks for the plan")
@click.option("--dp", type=int, default=1, show_default=True)
@click.option("--depth", type=int, default=1, show_default=True)
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that the layout accepts]")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="micro-batches per step (activations of one micro-batch, its traffic N times)")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="format of the estimate: float16/bfloat16 count 16-bit activations, panels and their "
                   "sums, float32 statistics, master weights, gradients and AdamW moments")
@click.option("--vocab-size", type=int, default=None,
              help="vocabulary for the estimate  [default: 256, the byte tokenizer's]")
@click.option("--zero", type=click.Choice(["0", "1"]), default="0", show_default=True,
              callback=lambda ctx, param, value: int(value),
              help="the estimate with the optimizer state sharded over --dp (as train --zero 1)")
@recompute_option
@click.option("--json", "as_json", is_flag=True,
              help="end stdout with one JSON line of the chosen layout's and options' figures per rank per step")
def info(n_layer, n_head, n_embd, seq_len, layout, world_size, dp, depth, batch_size, grad_accum, dtype,
         vocab_size, zero, recompute, as_json):
    """Model size; with --layout/-n, the sharding plan, per-rank predictions
    and every memory option (--recompute, --zero) with what it costs."""
    from .config import ModelConfig
    from .data import VOCAB_SIZE
    from .grid import validate_model

    cfg = ModelConfig(vocab_size=vocab_size or VOCAB_SIZE, n_ctx=seq_len, n_layer=n_layer, n_head=n_head,
                      n_embd=n_embd)
    validate_model(cfg)
    n = cfg.n_params()
    h = cfg.n_embd
    embed = (cfg.vocab_size + cfg.n_ctx) * h
    per_layer = (n - embed - 2 * h) // cfg.n_layer
    from .costmodel import Widths

    w = Widths.of(dtype)
    echo(f"model: GPT-2, n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {h}, n_ctx {cfg.n_ctx}, "
         f"vocab {cfg.vocab_size}")
    echo(f"parameters: {n:,} (embeddings {embed:,}, {cfg.n_layer} layers x {per_layer:,}, ln_f {2 * h:,})")
    working = n * w.act if w.act != w.grad else 0           # mixed precision: a 16-bit working copy too
    echo(f"memory: {_mib(n * w.grad + working)} of parameters in {dtype}"
         + (f" (float32 master + {dtype} working copy)" if working else "")
         + f"; {_mib(4 * n * w.grad + working)} with gradients and AdamW moments (before sharding)")
    if layout is not None or world_size is not None:
        from .costreport import memory_options, report, summary
        from .grid import default_batch

        echo()
        if batch_size is None:
            batch_size, why = default_batch(layout or "auto", cfg, world_size or 1, dp, depth, grad_accum,
                                            recompute=recompute)
            echo(why)
        args = (layout or "auto", cfg, batch_size, world_size or 1, dp, depth)
        options = dict(dtype=dtype, recompute=recompute, grad_accum=grad_accum, zero=zero)
        echo(report(*args, **options))
        echo()
        echo(memory_options(cfg, batch_size, world_size or 1, dp, dtype, grad_accum))
        if as_json:
            echo(json.dumps(summary(*args, **options)))
    elif as_json:
        raise UserError("info --json describes a layout: give --layout and/or -n")


@cli.command()
@click.option("--layout", "layouts", type=click.Choice(LAYOUT_CHOICES), multiple=True,
              help="layout(s) to time, each in turn in the same job  [default: auto]")
@click.option("--dp", type=int, default=1, show_default=True,
              help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")
@click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")
@model_options
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that each layout accepts]")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="micro-batches per step: forward+backward on batch/N sequences at a time, one update")
@click.option("--warmup-steps", type=int, default=2, show_default=True, help="untimed steps first")
@click.option("--steps", type=int, default=5, show_default=True, help="timed steps")
@click.option("--seed", type=int, default=0, show_default=True)
@device_options
@recompute_option
@click.option("--json", "as_json", is_flag=True, help="end stdout with one JSON object of the results")
@click.option("--zero", type=click.Choice(["0", "1"]), default="0", show_default=True,
              callback=lambda ctx, param, value: int(value),
              help="1: the optimizer state sharded over --dp (as train --zero 1)")
def bench(layouts, dp, depth, n_layer, n_head, n_embd, seq_len, batch_size, grad_accum, warmup_steps, steps, seed,
          dtype, device, tf32, recompute, zero, as_json):
    """Time training steps; compare with the cost model and a plain matmul.

    Prints the median step time and spread, tokens/s, model FLOP/s and their
    fraction of the same process's matmul rate, the forward/backward/sync/
    optimizer split, time inside MPI, measured vs predicted communication and
    memory per rank (rank 0's figures).
    """
    from . import threads
    from .bench import bench_layout, format_table
    from .config import ModelConfig
    from .data import VOCAB_SIZE
    from .grid import default_batch
    from .parts import recompute_note
    from .train import build_parts

    if steps < 1 or warmup_steps < 0:
        raise UserError("--steps must be at least 1 and --warmup-steps at least 0")
    cfg = ModelConfig(vocab_size=VOCAB_SIZE, n_ctx=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    results, noted = [], set()
    for name in layouts or ("auto",):
        layout_depth = depth if name in ("2.5d", "auto") else 1
        batch = batch_size
        if batch is None:                                  # each layout its own smallest batch
            batch, why = default_batch(name, cfg, _mpi["world"].Get_size(), dp, layout_depth, grad_accum,
                                       recompute=recompute)
            echo(f"bench {name}: {why}")
        parts = build_parts(cfg, name, batch, _mpi["world"], dp=dp, depth=layout_depth, dtype=dtype, device=device,
                            seed=seed, tf32=tf32, grad_accum=grad_accum, recompute=recompute,
                            zero=zero)
        note = recompute_note(parts.layout, recompute)
        if note and note not in noted:
            noted.add(note)
            echo(note)
        results.append(bench_layout(parts, seq_len, warmup_steps, steps, seed))
    echo(format_table(results, 4 if dtype == "float32" else 8))
    echo(f"threads: {threads.current().describe()}")
    if as_json:
        first = results[0]
        echo(json.dumps({"step_time_s": first["step_time_s"], "tokens_per_s": first["tokens_per_s"],
                         "gemm_fraction": first["gemm_fraction"], "threads": threads.current().to_dict(),
                         "results": results}))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


@cli.command()
@click.argument("ckpt")
def inspect(ckpt):
    """Report a model file's contents and check it; exit 1 if damaged.

    A mpicube checkpoint: every shard's checksum. A Hugging Face GPT-2
    directory or an llm.c model file: its configuration and every tensor,
    read whole.
    """
    from .checkpoint import inspect as inspect_checkpoint
    from .formats import detect
    from .formats.report import inspect_model
    from .state import model_shapes

    if detect(ckpt) == "mpicube":
        ok, report = inspect_checkpoint(ckpt, expected=model_shapes)
    else:
        ok, report = inspect_model(ckpt)
    echo(report)
    return 0 if ok else 1


@cli.command()
@click.argument("src")
@click.argument("dst")
@click.option("--to", "to", type=click.Choice(["mpicube", "hf", "llmc"]), required=True,
              help="format to write: a mpicube run directory, a Hugging Face GPT-2 directory or an llm.c file")
@click.option("--max-shard-size", type=str, default=None, metavar="SIZE",
              help="hf: split the weights into safetensors files of at most SIZE (e.g. 2GB, 500MB)")
def convert(src, dst, to, max_shard_size):
    """Convert a model between mpicube, Hugging Face and llm.c formats.

    SRC's format is detected: a mpicube checkpoint (run dir, step dir or
    checkpoint.h5), a Hugging Face GPT-2 directory (config.json and
    safetensors) or an llm.c model file. Tensors are copied exactly.
    """
    from .comm import on_root
    from .formats.convert import convert as run_convert, parse_size

    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    summary = on_root(_mpi["world"], lambda: run_convert(src, dst, to, limit))
    cfg = summary["config"]
    echo(f"read {summary['source']}: n_layer {cfg['n_layer']}, n_head {cfg['n_head']}, n_embd {cfg['n_embd']}, "
         f"n_ctx {cfg['n_ctx']}, vocab {cfg['vocab_size']} ({', '.join(summary['dtypes'])})")
    for note in summary["notes"]:
        echo(note)
    echo(f"wrote {summary['destination']} ({to}): " + ", ".join(summary["files"]))


@cli.command()
@click.argument("model")
@click.option("--prompt", type=str, default=None, help="text to continue (byte-level or GPT-2 BPE models)")
@click.option("--prompt-tokens", type=str, default=None, metavar="IDS",
              help="token ids to continue, comma-separated: 1,2,3 (any vocabulary)")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True, help="sample among the k likeliest (0 = all)")
@click.option("--seed", type=int, default=1337, show_default=True)
@click.option("--cache/--no-cache", default=True, show_default=True,
              help="key/value cache; --no-cache recomputes the whole prefix for every token")
@layout_options
@device_options
@click.option("--json", "as_json", is_flag=True, help='end stdout with {"tokens": [...], "text": ...}')
def generate(model, prompt, prompt_tokens, max_new_tokens, temperature, top_k, seed, cache, layout, dp, depth,
             dtype, device, tf32, as_json):
    """Continue a prompt with any model file, on any layout.

    MODEL is a mpicube checkpoint, a Hugging Face GPT-2 directory or an
    llm.c model file. Without a prompt, generation starts from a newline
    (byte-level models) or <|endoftext|> (GPT-2's vocabulary). The same
    seed gives the same tokens on every layout and world size.
    """
    from .generate import GenerateOptions
    from .generate import generate as run_generate

    opts = GenerateOptions(model, prompt, prompt_tokens, max_new_tokens, temperature, top_k, seed, cache, layout,
                           dp, depth, dtype, device, tf32)
    result = run_generate(opts, _mpi["world"])
    if result["text"] is not None:
        echo(result["prompt_text"] + result["text"])
    else:
        echo("tokens: " + " ".join(map(str, result["prompt_tokens"])) + " | " + " ".join(map(str, result["tokens"])))
    per_token = result["per_token_s"]
    echo(f"{len(result['tokens'])} new tokens, prompt {len(result['prompt_tokens'])} tokens in "
         f"{result['prefill_s'] * 1e3:.1f} ms" + (f", {per_token * 1e3:.2f} ms per new token" if per_token else "")
         + (" (key/value cache)" if cache else " (no cache)"))
    if as_json:
        echo(json.dumps({"tokens": result["tokens"], "text": result["text"],
                         "prompt_tokens": result["prompt_tokens"], "prefill_s": result["prefill_s"],
                         "per_token_s": per_token, "cache": cache, "layout": result["layout"]}))


# `trace` takes these options of `train`, as train defines them (same defaults and help).
TRACE_TRAIN_OPTIONS = ("config", "layout", "dp", "depth", "n_layer", "n_head", "n_embd", "seq_len", "batch_size",
                       "lr", "warmup", "weight_decay", "grad_clip", "dropout", "seed", "device", "dtype", "tf32",
                       "data", "init_from", "loss_scale", "loss_scale_growth_interval", "loss_scale_backoff")


@cli.command("trace")
@click.option("--steps", type=int, default=3, show_default=True,
              help="training steps to trace (also the length of the LR schedule)")
@click.option("--out", required=True, metavar="FILE.h5", help="the trace file to write")
@click.option("--max-bytes", default="2GB", show_default=True,
              help="refuse a trace larger than this (bytes, or a number with K, M or G)")
def trace_command(**kwargs):
    """Run N training steps and write every tensor of them to a trace.

    Any layout and world size; rank 0 writes full logical tensors: the
    batches, the initial parameters and, per step, the activations after
    each block, logits, loss, gradients, updated parameters and dropout
    masks (format mpicube-trace v1, docs/trace-format.md). Check it against
    another trace with `mpicube compare`.
    """
    from .trace import run_trace

    run_trace(kwargs, _mpi["world"], say=echo)


trace_command.params[:0] = [p for p in train.params if p.name in TRACE_TRAIN_OPTIONS]


@cli.command()
@click.argument("trace_a", metavar="A.h5")
@click.argument("trace_b", metavar="B.h5")
@click.option("--rtol", type=float, default=None,
              help="relative tolerance, against the larger max |x| of the two tensors  "
                   "[default: 1e-10 float64, 1e-3 float32, 5e-2 float16/bfloat16]")
@click.option("--atol", type=float, default=None,
              help="absolute tolerance  [default: 1e-13 float64, 1e-6 float32, 1e-3 float16/bfloat16]")
@click.option("--json", "as_json", is_flag=True,
              help='end stdout with {"first_divergence": NAME or null, "max_rel": ..., "tensors": N}')
def compare(trace_a, trace_b, rtol, atol, as_json):
    """Compare two traces tensor by tensor; name the first divergence.

    A tensor agrees when max |a - b| <= atol + rtol * max(max |a|, max |b|);
    defaults follow the coarser dtype of the two traces. The first
    divergence is named in the order the computation happens: the batches,
    the initial parameters, then per step the forward (emb, h.0, ...,
    ln_f, logits, loss), the gradients as backward produces them, the
    gradient norm and learning rate, the updated parameters. Exit status 0
    when all agree, 1 when something diverges, 2 when a file is not a trace
    or the two model configs differ.
    """
    from .comm import on_root
    from .compare import compare_traces, format_report

    result = on_root(_mpi["world"], lambda: compare_traces(trace_a, trace_b, rtol, atol))
    echo(format_report(result))
    if as_json:
        echo(json.dumps(result.summary()))
    return 0 if result.first_divergence is None else 1


# --------------------------------------------------------------------------- entry point


def main(argv=None) -> None:
    """Console entry point: run a command, turn errors into exit statuses."""
    _init_mpi()
    try:
        status = cli.main(args=argv, prog_name="mpicube", standalone_mode=False)
    except (KeyboardInterrupt, click.exceptions.Abort):
        _fail("interrupted", EXIT_INTERRUPTED, agree=False)
    except click.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":      # bare `mpicube` (click >= 8.2): the help
            echo(exc.format_message())
            sys.exit(EXIT_USAGE)
        _fail(_click_message(exc), EXIT_USAGE)
    except UserError as exc:          # DataError and CheckpointError are UserErrors too
        _fail(str(exc), getattr(exc, "exit_code", EXIT_USAGE))
    except Exception:  # noqa: BLE001 - anything else is a bug: traceback, abort the job
        _crash()
    sys.stdout.flush()
    sys.exit(status if isinstance(status, int) else 0)


def _init_mpi() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _mpi["world"] = world
    if world.Get_size() > 1 and _mpi["errors"] is None:
        _mpi["errors"] = world.Dup()   # errors are agreed here, never in a communicator a collective may be using


def _click_message(exc: click.ClickException) -> str:
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def _all_ranks_failed(timeout: float) -> bool:
    """Whether every rank reaches this point within ``timeout`` seconds."""
    request = _mpi["errors"].Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _grace_seconds() -> float:
    try:
        return float(os.environ.get("MPICUBE_ERROR_GRACE", "3"))
    except ValueError:
        return 3.0


def _fail(message: str, status: int, agree: bool = True) -> None:
    """Report a user-facing error once and end the job with ``status``."""
    world = _mpi["world"]
    message = " ".join(message.split()) or "failed"
    if world is None or world.Get_size() == 1:
        click.echo(f"error: {message}", err=True)
        sys.exit(status)
    if agree and _all_ranks_failed(_grace_seconds()):
        if world.Get_rank() == 0:
            click.echo(f"error: {message}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(status)
    # Other ranks are still busy or waiting in a collective: this rank speaks and ends the job.
    click.echo(f"error: rank {world.Get_rank()}: {message}", err=True)
    _abort(world, status)


def _abort(world, status: int) -> None:
    """MPI_Abort the job; it may return before the launcher has killed this
    process, and nothing may run after it. MPI_Abort tears the job down at
    once, and output this rank has just written may still be on its way
    through the launcher: pause a moment first so the message is not lost."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_PAUSE)
    world.Abort(status)
    os._exit(status)


def _crash() -> None:
    """An unexpected exception: traceback with the rank, then abort every rank."""
    world = _mpi["world"]
    text = traceback.format_exc()
    if world is not None and world.Get_size() > 1:
        rank = world.Get_rank()
        text = "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))
    sys.stdout.flush()
    sys.stderr.write(text)
    sys.stderr.flush()
    if world is not None and world.Get_size() > 1:
        _abort(world, 1)
    sys.exit(1)
