"""``mpicube train``, ``eval``, ``prepare`` and ``trace``: the commands that
read data and run the model forward (and backward). Registered on the
group of ``mpicube.cli``, whose error handling they share."""

from __future__ import annotations

import json
import math

import click

from ..core.errors import UserError
from .common import (SEED, Duration, _load_config, _mpi, arch_options, cli, collective_timeout_option, echo,
                     env_settings, model_options, profile_option, watched)
from .parallel_options import grad_accum_option, recompute_option, sharing_options, zero_option
from .precision_options import device_options, fp8_options
from ..core.config import DEEPSEEK_OPTIONS
from .sections import TRAIN_EPILOG, SectionedCommand


@cli.command(cls=SectionedCommand, epilog=TRAIN_EPILOG)
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config, is_eager=True,
              expose_value=False, help="TOML file of option values (keys as option names); "
                                       "options on the command line override it")
@sharing_options
@model_options
@arch_options
@click.option("--vocab-size", type=int, default=256, show_default=True,
              help="vocabulary (256: byte-level tokens; 50257: GPT-2's BPE); --init-from's model sets its own")
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that the layout accepts]")
@grad_accum_option("micro-batches per step: forward+backward on batch/N sequences at a time, one update")
@click.option("--steps", type=int, default=500, show_default=True, help="optimizer steps (LR schedule length)")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="peak learning rate")
@click.option("--warmup", type=int, default=20, show_default=True, help="linear warmup steps, then cosine decay")
@click.option("--weight-decay", type=float, default=0.1, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="global norm clip (0 = off)")
@click.option("--optimizer", type=click.Choice(["adamw", "sgd", "muon"]), default="adamw", show_default=True,
              help="sgd: plain SGD (p -= lr g, no momentum, no weight decay), a reference mode in which a wrongly "
                   "scaled gradient moves the parameters by that scale (AdamW divides it out); muon: Newton-Schulz "
                   "orthogonalised Nesterov momentum for the hidden matrices (gathered whole on every layout and "
                   "ZeRO stage), AdamW for embeddings, head, norms and biases")
@click.option("--muon-qkv", type=click.Choice(["split", "joint"]), default="split", show_default=True,
              help="--optimizer muon: orthogonalise c_attn's q, k, v (and SwiGLU's gate, up) as separate "
                   "matrices, or as one")
@click.option("--dropout", type=float, default=0.0, show_default=True, help="dropout probability (0 = off)")
@click.option("--seed", type=SEED, default=1337, show_default=True, help="initialisation, data order, dropout")
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
                   "run dir, saved on any layout), a Hugging Face GPT-2, Llama, Mixtral or DeepseekV3 directory or an llm.c "
                   "model file (the family comes from the file unless --arch is given); "
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
@fp8_options
@zero_option("1: shard the AdamW moments (and a 16-bit run's float32 master weights) over the --dp "
             "replicas; gradients reduce-scattered, parameters all-gathered; 2: also the gradients, "
             "reduce-scattered per layer during backward; 3: also the weights, all-gathered per layer "
             "just before it runs")
@click.option("--hsdp", type=int, default=1, show_default=True,
              help="with --zero 3: the --dp replicas as R replicas of dp/R-way shard groups (HSDP): weights, "
                   "gradients and moments sharded inside a group, the gradient chunks all-reduced across groups")
@profile_option("steps START to STOP into RUN_DIR/profile.json (draw it with `mpicube timeline RUN_DIR`)")
@collective_timeout_option
def train(collective_timeout, profile, **kwargs):
    """Train a GPT-2, Llama (--arch llama), Mixtral (--arch mixtral) or DeepSeek-V3 (--arch deepseek_v3) model.

    Writes RUN_DIR/config.json, RUN_DIR/metrics.jsonl (one JSON object per
    step) and checkpoints in RUN_DIR/ckpt/. SIGTERM, SIGUSR1 or Ctrl-C on
    any rank (or --time-limit) writes a checkpoint and exits with status 75
    (a second Ctrl-C: at once, status 130);
    `--resume` continues exactly where it stopped.
    """
    from ..training.hooks import Faults
    from ..training.launch import FAMILY_OPTIONS, SHAPE_OPTIONS
    from ..training.options import TrainOptions
    from ..training.train import Trainer

    opts = TrainOptions(**kwargs, **env_settings())
    ctx = click.get_current_context()      # a model file decides the shape options nobody gave
    opts.given_shape = tuple(k for k in SHAPE_OPTIONS + FAMILY_OPTIONS
                             if ctx.get_parameter_source(k) not in (click.core.ParameterSource.DEFAULT, None))
    faults = Faults.from_environment()           # the test suite's, read here with the rest of the environment
    hooks = [faults] if faults is not None else []
    recorder = None
    if profile is not None and profile[1] > opts.last_step:
        raise UserError(f"--profile {profile[0]}:{profile[1]} ends after the last step this run trains, "
                        f"{opts.last_step} (--steps, --stop-after)")
    if profile is not None:
        from ..analysis.profile import ProfileHooks

        profiling = ProfileHooks(profile, echo)
        hooks.append(profiling)
        recorder = profiling.recorder            # handed to the communicators as they are built
    with watched(collective_timeout, "setup"):
        return Trainer(opts, _mpi["world"], hooks=hooks, recorder=recorder).run()


@cli.command("eval")
@click.argument("ckpt", metavar="MODEL")
@click.option("--data", type=str, default=None, metavar="PATH",
              help="token shard to evaluate on  [default: the validation shard of the data the checkpoint "
                   "was trained on; the built-in corpus's for a model without one]")
@click.option("--batch-size", type=int, default=None,
              help="sequences per batch  [default: the checkpoint's training batch size]")
@click.option("--seq-len", type=int, default=None, help="sequence length  [default: the model's context]")
@click.option("--batches", type=int, default=8, show_default=True, help="evaluation batches (0 = all)")
@sharing_options
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="micro-batches per batch (the pipeline's; the loss is the same)")
@device_options
@collective_timeout_option
def eval_command(ckpt, data, batch_size, seq_len, batches, layout, dp, depth, pp, pp_schedule, virtual_stages, cp,
                 cp_kind, ulysses, grad_accum, dtype, device, tf32, collective_timeout, sequence_parallel, ep):
    """Mean cross-entropy of a model on a token shard.

    MODEL is a mpicube checkpoint, a Hugging Face GPT-2, Llama, Mixtral or DeepseekV3 directory or an
    llm.c model file.

    Batch k, row r starts at token (k*B + r)*T. The last line of stdout is a
    JSON object with "loss", "step" and "tokens".
    """
    from ..parallel.gridspec import Plan
    from ..training.evaluate import EvalData, evaluate_checkpoint
    from ..training.parts import Numerics
    from ..training.state import describe_layout

    with watched(collective_timeout, "evaluation"):
        plan = Plan(layout, dp=dp, cp=cp, cp_kind=cp_kind, ulysses=ulysses, depth=depth, pp=pp, pp_schedule=pp_schedule,
                    virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, grad_accum=grad_accum, ep=ep,
                    **env_settings())
        result = evaluate_checkpoint(ckpt, plan, Numerics(dtype, device, tf32), _mpi["world"],
                                     EvalData(data, batch_size, seq_len, batches))
    if result.get("note"):
        echo(result["note"])
    if result.get("batch_note"):
        echo(f"{describe_layout(result['layout'])}, {result['batch_note']}")
    loss = result["loss"]
    if math.isfinite(loss):
        said = f"loss {loss:.6f}"
    else:                       # NaN is not JSON: the last line says null, and this line why
        said = f"loss {loss} (not finite: the model's weights or logits hold NaN or inf; \"loss\" is null)"
        result["loss"] = None
    echo(f"{result['checkpoint']} (step {result['step']}): {said} over {result['batches']} "
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
    """Tokenize text files and folders into train/val shards (uint16 token ids; uint32 past 65,535)."""
    from ..files import data, tokenizers
    from ..parallel.comm import on_root

    def run():
        encode = None if tokenizer == "bytes" else tokenizers.load(tokenizer).encode
        return [str(p) for p in data.prepare(list(inputs), out, val_fraction, encode)]

    paths = on_root(_mpi["world"], run)
    for path in paths:
        echo(f"wrote {path}: {len(data.read_shard(path)):,} tokens")


TRACE_TRAIN_OPTIONS = ("config", "layout", "dp", "cp", "cp_kind", "ulysses", "hsdp", "muon_qkv", "depth",
                       "pp", "pp_schedule", "virtual_stages", "n_layer",
                       "n_head", "n_embd", "seq_len", "batch_size",
                       "lr", "warmup", "weight_decay", "grad_clip", "optimizer", "dropout", "seed", "device", "dtype",
                       "tf32",
                       "data", "init_from", "stop_after", "loss_scale", "loss_scale_growth_interval", "loss_scale_backoff",
                       "grad_accum", "recompute", "zero", "sequence_parallel", "vocab_size", "arch", "n_kv_head", "ffn_hidden",
                       "rope_theta", "rms_eps", "tie_embeddings", "ep", "n_experts", "top_k", "no_norm_topk",
                       "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "fp8", "fp8_grad_format",
                       "fp8_accumulate", "fp8_amax_history", "fp8_amax_rule", "fp8_block", "fp8_pow2", "q_lora_rank",
                       "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                       "mtp_depth", "mtp_loss_weight") + DEEPSEEK_OPTIONS


@cli.command("trace", cls=SectionedCommand)
@click.option("--steps", type=int, default=3, show_default=True,
              help="training steps to trace (also the length of the LR schedule)")
@click.option("--out", required=True, metavar="FILE.h5", help="the trace file to write")
@click.option("--max-bytes", default="2GB", show_default=True,
              help="refuse a trace larger than this (bytes, or a number with K, M or G)")
@click.option("--sharded", is_flag=True, default=False,
              help="write each rank's block of every tensor with its global index, replicas included, instead of "
                   "the assembled tensors, with each block's placement on the mesh (pp, dp, cp, tp); compare puts "
                   "them together, sums pending sums and checks that replicas agree")
@click.option("--state", is_flag=True, default=False,
              help="also write per step the training state after the update: AdamW's moments, the loss scale, "
                   "the RNG offset and a mixture's expert loads")
@click.option("--envelope", type=click.IntRange(min=0), default=0, metavar="N",
              help="on one rank: write the float64 reference with per-tensor tolerances measured from N reruns at "
                   "--dtype with the reduction orders varied (--grad-accum, attention), for compare --tolerance "
                   "envelope")
@click.option("--run-dir", "run_dir", default=None, metavar="RUN_DIR",
              help="also keep a run directory, as train --out does: its config, metrics and a checkpoint after "
                   "the last step traced (--stop-after); with --resume, continue its latest checkpoint and trace "
                   "the steps after it (what check-resume runs)")
@click.option("--resume", is_flag=True, default=False,
              help="continue --run-dir's latest checkpoint on this layout and world size (refused when it has "
                   "none)")
@click.option("--suite", type=click.Choice(["edge"]), default=None,
              help="write the reference traces of the configurations that have broken frameworks (ragged "
                   "batches, an indivisible vocabulary, idle experts, tp x cp, ragged pipelines) into the folder "
                   "--out, on one rank")
def trace_command(**kwargs):
    """Run N training steps and write every tensor of them to a trace.

    Any layout and world size, GPT-2, Llama or a mixture of experts
    (--arch mixtral, any --ep); rank 0 writes full logical
    tensors: the batches, the initial parameters and, per step, the
    activations inside and after each block, a mixture's router logits,
    chosen experts and weights, logits, loss, gradients (every expert's),
    updated parameters and dropout masks (format mpicube-trace v3,
    docs/trace-format.md). Check it against
    another trace with `mpicube compare`.
    """
    from ..analysis.trace import run_trace

    if kwargs.get("suite"):
        from ..analysis.suite import run_suite

        run_suite({**kwargs, **env_settings()}, _mpi["world"], say=echo)
        return
    if kwargs.get("envelope"):
        from ..analysis.envelope import run_envelope

        run_envelope({**kwargs, **env_settings()}, _mpi["world"], say=echo)
        return
    run_trace({**kwargs, **env_settings()}, _mpi["world"], say=echo)


trace_command.params[:0] = [p for p in train.params if p.name in TRACE_TRAIN_OPTIONS]
