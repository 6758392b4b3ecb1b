"""``mpicube info``, ``bench``, ``inspect``, ``convert`` and ``generate``:
the commands about a model, its files and its costs.
Registered on the group of ``mpicube.cli``, whose error handling they
share."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from .common import (LAYOUT_CHOICES, SEED, _mpi, arch_options, cli, collective_timeout_option, echo, env_settings,
                     family_fields, model_options, profile_option, watched)
from .parallel_options import (cp_option, ep_option, grad_accum_option, info_step_options, layout_options,
                               pipeline_options, recompute_option, sequence_parallel_option, zero_option)
from .precision_options import DTYPE_CHOICES, device_options, fp8_recipe_options
from ..core.errors import UserError


@cli.command()
@model_options
@click.option("--layout", type=click.Choice(LAYOUT_CHOICES), default=None,
              help="also show this layout's sharding plan and cost predictions")
@click.option("-n", "--world-size", type=int, default=None, help="number of ranks for the plan")
@click.option("--dp", type=int, default=1, show_default=True,
              help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")
@click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that the layout accepts]")
@grad_accum_option("micro-batches per step (activations of one micro-batch, its traffic N times)")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="format of the estimate: float16/bfloat16 count 16-bit activations, panels and their "
                   "sums, float32 statistics, master weights, gradients and AdamW moments")
@click.option("--vocab-size", type=int, default=None,
              help="vocabulary for the estimate  [default: 256, the byte tokenizer's]")
@zero_option("the estimate with the optimizer state (1), also the gradients (2), also the weights (3) sharded "
             "over --dp (as train --zero)")
@recompute_option
@pipeline_options
@click.option("--pipelines", is_flag=True,
              help="also show every dp x pp x tp combination at this world size (memory, traffic per link class, "
                   "cross-node bytes, bubble); implied by --pp > 1")
@click.option("--ranks-per-node", type=int, default=8, show_default=True,
              help="consecutive ranks that share a node, for the cross-node bytes of --pipelines")
@click.option("--json", "as_json", is_flag=True,
              help="end stdout with one JSON line of the chosen layout's and options' figures per rank per step")
@cp_option
@sequence_parallel_option
@arch_options
@ep_option
@click.option("--experts", "show_experts", is_flag=True,
              help="moe: also show which experts, and which shard of each, every rank holds (needs -n)")
@click.option("--heads", "show_heads", is_flag=True,
              help="also show which query and kv heads each tensor-parallel rank holds, and which ranks share "
                   "a replicated kv head (needs --layout and/or -n)")
@info_step_options
@fp8_recipe_options
def info(n_layer, n_head, n_embd, seq_len, layout, world_size, dp, depth, batch_size, grad_accum, dtype,
         vocab_size, zero, recompute, pp, pp_schedule, virtual_stages, pipelines, ranks_per_node, as_json, cp,
         sequence_parallel, show_heads, ep, show_experts, optimizer, hsdp, fp8, **family):
    """Model size; with --layout/-n, the sharding plan, per-rank predictions
    and every memory option (--recompute, --zero) with what it costs; with
    --pp, each pipeline stage and the dp x pp x tp combinations; with
    --heads, each rank's query and kv heads."""
    from ..core.config import ModelConfig, family_fields
    from ..files.data import VOCAB_SIZE
    from ..parallel.grid import validate_model

    cfg = ModelConfig(vocab_size=vocab_size or VOCAB_SIZE, n_ctx=seq_len, n_layer=n_layer, n_head=n_head,
                      n_embd=n_embd, **family_fields(**family))
    validate_model(cfg)
    n = cfg.n_params()
    h = cfg.n_embd
    from ..analysis.costmodel import Widths
    from ..analysis.param_counts import param_counts, params_line

    w = Widths.of(dtype)
    family_line = (f"Llama ({cfg.kv_heads} kv heads, SwiGLU {cfg.ffn}, {'tied' if cfg.tied else 'untied'} head)"
                   if cfg.llama else "GPT-2")
    if cfg.mla:
        family_line = (f"DeepSeek-V3 (latent attention: q rank {cfg.q_lora_rank or 'none'}, kv rank {cfg.kv_lora_rank}, "
                       f"rope {cfg.qk_rope_head_dim}, nope {cfg.qk_nope_head_dim}, v {cfg.v_head_dim}; dense SwiGLU "
                       f"{cfg.ffn}, {'tied' if cfg.tied else 'untied'} head)")
    if cfg.moe:
        family_line += f" with a mixture of {cfg.n_experts} experts, top {cfg.top_k}"
    echo(f"model: {family_line}, n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {h}, n_ctx {cfg.n_ctx}, "
         f"vocab {cfg.vocab_size}")
    echo(params_line(cfg, param_counts(cfg)))
    working = n * w.act if w.act != w.grad else 0           # mixed precision: a 16-bit working copy too
    echo(f"memory: {_mib(n * w.grad + working)} of parameters in {dtype}"
         + (f" (float32 master + {dtype} working copy)" if working else "")
         + f"; {_mib(4 * n * w.grad + working)} with gradients and AdamW moments (before sharding)")
    if layout is not None or world_size is not None:
        from ..analysis.costreport import fp8_report, memory_options, report, summary, zero_options
        from ..parallel.gridspec import Plan
        from ..parallel.planning import resolve

        world = world_size or 1
        # The plan validated as train validates it (one plan, once): every
        # axis against the world, the pipeline, zero and their combinations.
        plan = Plan(layout or "auto", dp=dp, pp=pp, cp=cp, depth=depth, pp_schedule=pp_schedule,
                    virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, zero=zero,
                    recompute=recompute, grad_accum=grad_accum, ep=ep, hsdp=hsdp, fp8=fp8)
        run = resolve(plan, cfg, batch_size, world)
        notes = (run.pipeline_note, fp8 and fp8_report(fp8, run, cfg, dtype) + "\n")   # --fp8: what it quantizes, how
        note = "\n".join(n for n in notes if n)
        if show_heads:
            from ..analysis.heads import heads_table

            echo()
            echo(heads_table(run.layout, cfg, run.tp, depth if run.layout == "2.5d" else 1))
        echo()
        if batch_size is None:
            batch_size = run.batch_size
            echo(run.batch_note)
        if note:
            echo(note)
        if cfg.moe:                      # the experts' own section; the tables below price the rest
            from ..analysis.costmoe import moe_report

            echo(moe_report(cfg, batch_size, world, dp, ep, run.tp, w.act, recompute, grad_accum, cp=cp,
                            layout=run.layout, depth=depth, dtype=dtype, zero=zero, pp=pp, schedule=pp_schedule,
                            virtual=virtual_stages))
            if show_experts:
                from ..analysis.costplace import dispatch_picture, placement_table

                echo()
                echo(placement_table(run))
                echo()
                echo(dispatch_picture(run))
            echo()
        if pp > 1:
            from ..analysis.costpipereport import pipeline_report

            echo(pipeline_report(layout or "auto", cfg, batch_size, world, dp, depth, pp, pp_schedule,
                                 virtual_stages, dtype, recompute, grad_accum, zero, ranks_per_node, cp=cp,
                                 sequence_parallel=sequence_parallel, ep=ep))
        else:
            args = (layout or "auto", cfg, batch_size, world, dp, depth)
            options = dict(dtype=dtype, recompute=recompute, grad_accum=grad_accum, zero=zero)
            echo(report(*args, **options, cp=cp, sequence_parallel=sequence_parallel, ep=ep, optimizer=optimizer,
                        hsdp=hsdp))
            echo()
            echo(memory_options(cfg, batch_size, world, dp, dtype, grad_accum, ep=ep))
            if dp > 1:
                echo()
                echo(zero_options(cfg, batch_size, world, dp, dtype, grad_accum, recompute, ep=ep))
            if world % (dp * cp) == 0:
                from ..analysis.costcontext import context_tables

                echo()
                echo(context_tables(cfg, batch_size, world // (dp * cp), dp, dtype, recompute, ep=ep, kinds=cp > 1))
        if pipelines or pp > 1:
            from ..analysis.costpipereport import combinations_report

            echo()
            echo(combinations_report(cfg, batch_size, world, dtype, recompute, zero, ranks_per_node, ep=ep))
        if as_json:
            if pp > 1:
                from ..analysis.costpipereport import pipeline_summary

                echo(json.dumps(pipeline_summary(layout or "auto", cfg, batch_size, world, dp, depth, pp,
                                                 pp_schedule, virtual_stages, dtype, recompute, grad_accum, zero,
                                                 cp=cp, sequence_parallel=sequence_parallel, ep=ep)))
            else:
                echo(json.dumps(summary(layout or "auto", cfg, batch_size, world, dp, depth, dtype=dtype,
                                        recompute=recompute, grad_accum=grad_accum, zero=zero, cp=cp,
                                        sequence_parallel=sequence_parallel, ep=ep)))
    elif as_json or show_heads or fp8:
        raise UserError(f"info {'--json' if as_json else '--heads' if show_heads else '--fp8'} needs --layout or -n")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


@cli.command()
@click.option("--layout", "layouts", type=click.Choice(LAYOUT_CHOICES), multiple=True,
              help="layout(s) to time, each in turn in the same job  [default: auto]")
@click.option("--dp", type=int, default=1, show_default=True,
              help="data-parallel replicas; the world splits into dp x tensor-parallel ranks")
@click.option("--depth", type=int, default=1, show_default=True, help="depth d of the 2.5d layout")
@pipeline_options
@model_options
@arch_options
@click.option("--batch-size", type=int, default=None,
              help="global sequences per step  [default: the smallest of at least 8 that each layout accepts]")
@grad_accum_option("micro-batches per step: forward+backward on batch/N sequences at a time, one update")
@click.option("--warmup-steps", type=int, default=2, show_default=True,
              help="untimed steps first (not train's --warmup, the learning rate's warm-up)")
@click.option("--steps", type=int, default=5, show_default=True, help="timed steps")
@click.option("--seed", type=SEED, default=1337, show_default=True, help="initialisation, data order, dropout")
@device_options
@recompute_option
@click.option("--json", "as_json", is_flag=True, help="end stdout with one JSON object of the results")
@zero_option("1: the optimizer state sharded over --dp; 2: and the gradients; 3: and the weights (as train --zero)")
@profile_option("steps START to STOP (counted from 1 with the warm-up steps) into RUN_DIR/profile.json, "
                "timed apart from the others")
@click.option("--out", type=str, default=None, metavar="RUN_DIR",
              help="where --profile writes (several layouts: RUN_DIR/<layout>/)  [default: runs/bench-<time>]")
@cp_option
@sequence_parallel_option
@click.option("--overlap-both", is_flag=True,
              help="time each layout twice, its collectives blocking (as under MPICUBE_OVERLAP=0) and overlapped, "
                   "to show the exposed communication each leaves")
@fp8_recipe_options
@collective_timeout_option
def bench(layouts, dp, depth, pp, pp_schedule, virtual_stages, n_layer, n_head, n_embd, seq_len, batch_size,
          grad_accum, warmup_steps, steps, seed, dtype, device, tf32, recompute, zero, as_json, profile, out, cp,
          overlap_both, collective_timeout, sequence_parallel, fp8, **family):
    """Time training steps; compare with the cost model and a plain matmul.

    Prints the median step time and spread, tokens/s, model FLOP/s and their
    fraction of the same process's matmul rate, the forward/backward/sync/
    optimizer split, time inside MPI, measured vs predicted communication and
    memory per rank (rank 0's figures).
    """
    from ..device import threads
    from ..analysis.bench import bench_layout, format_table, threads_line
    from ..core.config import ModelConfig
    from ..files.data import VOCAB_SIZE
    from ..model.families import family_of
    from ..parallel.gridspec import Plan
    from ..parallel.planning import resolve
    from ..training.parts import Numerics, build_parts, recompute_note

    if steps < 1 or warmup_steps < 0:
        raise UserError("--steps must be at least 1 and --warmup-steps at least 0")
    if profile is not None and profile[1] > warmup_steps + steps:
        raise UserError(f"--profile {profile[0]}:{profile[1]} ends after the last step, "
                        f"{warmup_steps + steps} (--warmup-steps + --steps)")
    if profile is not None and overlap_both:
        raise UserError("--profile records one setting: drop --overlap-both, or profile each setting in its own run")
    profile_dir = _profile_dir(out) if profile is not None else None
    cfg = ModelConfig(vocab_size=VOCAB_SIZE, n_ctx=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                      **family_fields(**family))
    family_of(cfg).check(cfg)               # Llama's --n-kv-head dividing --n-head: before any layout says a word
    from ..device import blas_kernel

    pinned = blas_kernel.pin_warning()
    if pinned:
        echo(pinned)
    results, noted = [], set()
    with watched(collective_timeout, "bench"):
        for name in layouts or ("auto",):
            plan = Plan(name, dp=dp, cp=cp, depth=depth if name in ("2.5d", "auto") else 1, pp=pp,
                        pp_schedule=pp_schedule, virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
                        zero=zero, recompute=recompute, grad_accum=grad_accum, fp8=fp8, **env_settings())
            run = resolve(plan, cfg, batch_size, _mpi["world"].Get_size(), seq_len=seq_len)
            if batch_size is None:                             # each layout its own smallest batch
                echo(f"bench {name}: {run.batch_note}")
            for overlap in (False, True) if overlap_both else (plan.overlap,):
                # two settings, two plans: nothing in the process's environment changes
                setting = run if overlap == plan.overlap else replace(run, plan=plan.but(overlap=overlap))
                recorder = _recorder() if profile is not None else None    # the profile's, handed to the Comms
                parts = build_parts(setting, _mpi["world"], Numerics(dtype, device, tf32), seed, recorder=recorder)
                note = recompute_note(parts.layout, recompute)
                if note and note not in noted:
                    noted.add(note)
                    echo(note)
                session = None
                if profile is not None:
                    where = profile_dir / name if len(layouts) > 1 else profile_dir
                    meta = {"command": "bench", **parts.layout.describe()}
                    session = _session_factory(parts, profile, where, meta)
                results.append(bench_layout(parts, seq_len, warmup_steps, steps, seed, session))
    echo(format_table(results, 4 if dtype == "float32" else 8))
    echo(threads_line(threads.current(), results[0].get("kernel_threads")))
    echo(f"BLAS: {blas_kernel.describe()}")
    if as_json:
        first = results[0]
        echo(json.dumps({"step_time_s": first["step_time_s"], "tokens_per_s": first["tokens_per_s"],
                         "gemm_fraction": first["gemm_fraction"], "threads": threads.current().to_dict(),
                         "blas": blas_kernel.describe(), "blas_pin_warning": pinned,
                         "results": results}))


def _profile_dir(out):
    """bench --profile's run directory: --out, else runs/bench-<time> (rank 0's time, agreed)."""
    import time
    from pathlib import Path

    return Path(out if out is not None else _mpi["world"].bcast(time.strftime("runs/bench-%Y%m%d-%H%M%S"), root=0))


def _recorder():
    from ..parallel.profiler import Recorder

    return Recorder()


def _session_factory(parts, steps, where, meta):
    from ..analysis.profile import ProfileSession

    return lambda opt: ProfileSession(parts, opt, _mpi["world"], steps, where, echo, meta)


@cli.command()
@click.argument("ckpt", metavar="MODEL")
def inspect(ckpt):
    """Report a model file's contents and check it; exit 1 if damaged.

    MODEL is a mpicube checkpoint, a Hugging Face GPT-2, Llama, Mixtral or
    DeepseekV3 directory or an llm.c model file, as for eval and generate.

    A mpicube checkpoint: every shard's checksum. A Hugging Face GPT-2
    directory or an llm.c model file: its configuration and every tensor,
    read whole.
    """
    from ..files.checkpoint import inspect as inspect_checkpoint
    from ..files.formats import detect
    from ..files.formats.report import inspect_model
    from ..training.state import model_shapes

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
              help="format to write: a mpicube run directory, a Hugging Face directory (GPT2LMHeadModel or "
                   "LlamaForCausalLM, MixtralForCausalLM or DeepseekV3ForCausalLM, as the model is) or an llm.c file (a format that holds "
                   "GPT-2 only)")
@click.option("--max-shard-size", type=str, default=None, metavar="SIZE",
              help="hf: split the weights into safetensors files of at most SIZE (e.g. 2GB, 500MB)")
def convert(src, dst, to, max_shard_size):
    """Convert a model between mpicube, Hugging Face and llm.c formats.

    SRC's format is detected: a mpicube checkpoint (run dir, step dir or
    checkpoint.h5), a Hugging Face GPT-2, Llama, Mixtral or DeepseekV3 directory (config.json
    and safetensors) or an llm.c model file. Tensors are copied exactly.
    """
    from ..parallel.comm import on_root
    from ..files.formats.convert import convert as run_convert, parse_size

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
@click.option("--max-new-tokens", type=int, default=None,
              help="tokens to generate; more than the model's context holds after the prompt are clipped, "
                   "with a note  [default: 64, or as many as the context holds]")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True, help="sample among the k likeliest (0 = all)")
@click.option("--seed", type=SEED, default=1337, show_default=True, help="the sampler's draws")
@click.option("--cache/--no-cache", default=True, show_default=True,
              help="key/value cache; --no-cache recomputes the whole prefix for every token")
@layout_options
@ep_option
@pipeline_options
@device_options
@click.option("--json", "as_json", is_flag=True, help='end stdout with {"tokens": [...], "text": ...}')
def generate(model, prompt, prompt_tokens, max_new_tokens, temperature, top_k, seed, cache, layout, dp, depth, ep,
             pp, pp_schedule, virtual_stages, dtype, device, tf32, as_json):
    """Continue a prompt with any model file, on any layout.

    MODEL is a mpicube checkpoint, a Hugging Face GPT-2, Llama, Mixtral or
    DeepseekV3 directory or an llm.c model file (a mixture takes --ep over --dp, as in
    training). Without a prompt, generation starts from a newline
    (byte-level models) or <|endoftext|> (GPT-2's vocabulary). The same
    seed gives the same tokens on every layout and world size.
    """
    from .generate import GenerateOptions
    from .generate import generate as run_generate

    opts = GenerateOptions(model, prompt, prompt_tokens, max_new_tokens, temperature, top_k, seed, cache, layout,
                           dp, depth, pp, pp_schedule, virtual_stages, dtype, device, tf32, ep)
    result = run_generate(opts, _mpi["world"])
    if result["note"]:
        echo(result["note"])
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
