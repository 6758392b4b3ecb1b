"""``mpicube generate``: text from any model file, on any layout.

The prompt goes through the model once (prefill), filling every block's
key/value cache (mpicube.model.kvcache); after that each new token costs one
position's forward pass. Without the cache (``--no-cache``) every step
recomputes the whole prefix with the training forward pass, which is both
the reference the cache is tested against and the baseline it is timed
against.

Layouts split the batch, so the model runs on the smallest batch the
layout accepts, every row holding the same prompt, and row 0 is the one
continued. Its logits at the last position are assembled on every rank
(each piece has exactly one holder, so an all-reduce of max over blocks
padded with -inf copies them exactly); every rank then samples the same
token from the same host float64 vector with the same seeded generator.
So a seed gives the same tokens on every layout and world size (up to
logits that differ by rounding landing on either side of a draw).

A mixture of experts with ``--ep`` holds E/ep experts a rank, as in
training (the ep ranks are --dp replicas): at every forward, the prefill
and each new token, a rank routes its rows and the all-to-all carries them
to their experts' ranks and back (model/moe.py). It decodes dropless
(``generation_config``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..files import formats, tokenizers
from ..core.errors import ConfigError, UserError


@dataclass
class GenerateOptions:
    model: str
    prompt: Optional[str] = None
    prompt_tokens: Optional[str] = None       # "1,2,3"
    max_new_tokens: Optional[int] = None      # None: up to DEFAULT_NEW_TOKENS, as many as the context holds
    temperature: float = 1.0
    top_k: int = 0                            # 0: the whole vocabulary
    seed: int = 1337
    cache: bool = True
    layout: str = "auto"
    dp: int = 1
    depth: int = 1
    pp: int = 1                               # pipeline stages, run in turn for every token
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    tf32: bool = False
    ep: int = 1                               # expert-parallel ranks (a mixture of experts), taken from dp

    def validate(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens must be 0 or more, got {self.max_new_tokens}")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (no limit) or more, got {self.top_k}")
        if self.prompt is not None and self.prompt_tokens is not None:
            raise ConfigError("give --prompt or --prompt-tokens, not both")


DEFAULT_NEW_TOKENS = 64


def new_token_count(requested, prompt_len: int, n_ctx: int):
    """(how many tokens to generate, a note or None). The prompt and the
    new tokens share the model's n_ctx positions. Without --max-new-tokens
    the count is DEFAULT_NEW_TOKENS or what the context holds, whichever is
    fewer, silently; a requested count past the context is clipped to the
    largest that fits, with a note saying so (the README's quick start
    asks a 64-position model for 200). Only a prompt that leaves no room
    is refused, naming the largest count that fits and the longest prompt."""
    room = n_ctx - prompt_len                           # the largest count that fits
    if room < 0 or (room == 0 and requested != 0):
        raise UserError(f"the prompt ({prompt_len} tokens) leaves no room in the model's context of {n_ctx} "
                        f"positions: the largest --max-new-tokens that fits is 0; a prompt of at most "
                        f"{n_ctx - 1} tokens leaves room for one")
    if requested is None:
        return min(DEFAULT_NEW_TOKENS, room), None
    if requested > room:
        return room, (f"--max-new-tokens {requested} clipped to {room}, the largest that fits: the prompt "
                      f"({prompt_len} tokens) plus the new ones fill the model's context of {n_ctx} positions")
    return requested, None


class Sampler:
    """The next token from a logits vector: argmax at temperature 0, else a
    draw from softmax(logits / T) over the top k, by inverse CDF with one
    uniform per token from a generator seeded once, so the draw depends
    only on the seed and the logits."""

    def __init__(self, temperature: float, top_k: int, seed: int):
        self.temperature, self.top_k = temperature, top_k
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits (V,) float64 -> token id."""
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits / self.temperature                                      # (V,)
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())                                            # (V,)
        cdf = np.cumsum(p)
        u = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), z.size - 1))


def generation_batch(layout: str, cfg, world_size: int, dp: int, depth: int, pp: int = 1, ep: int = 1) -> int:
    """The smallest global batch the layout accepts: dp times the smallest
    per-replica batch that passes every size check. If none does, the
    check's own error (about something other than the batch) is raised."""
    from ..parallel.gridspec import Plan
    from ..parallel.planning import resolve

    return resolve(Plan(layout, dp=dp, depth=depth, pp=pp, ep=ep), cfg, None, world_size, at_least=1).batch_size


def generation_config(cfg):
    """(the model config generation runs, a note or None). A mixture of
    experts decodes dropless: a capacity (``--capacity-factor``) limits
    each expert to a share of the tokens of one forward, so with the
    key/value cache (one new position a step) it would drop other tokens
    than the uncached forward over the whole prefix, and than another
    batch; Mixtral itself has none."""
    if not (cfg.moe and cfg.capacity_factor):
        return cfg, None
    return replace(cfg, capacity_factor=0.0), (f"capacity factor {cfg.capacity_factor:g} not applied: generation "
                                               f"routes every token to its top {cfg.top_k} experts (dropless)")


def prompt_ids(opts: GenerateOptions, vocab_size: int, tokenizer_name):
    """(prompt token ids, tokenizer or None)."""
    tokenizer = None
    if opts.prompt_tokens is not None:
        try:
            ids = [int(t) for t in opts.prompt_tokens.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise UserError(f"--prompt-tokens {opts.prompt_tokens!r}: expected comma-separated integers") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"--prompt-tokens: token {bad[0]} is outside the model's vocabulary of {vocab_size}")
        if tokenizer_name is not None:
            try:
                tokenizer = tokenizers.load(tokenizer_name)
            except UserError:
                tokenizer = None           # tokens in, tokens out
    else:
        if tokenizer_name is None:
            raise UserError(f"a model with a vocabulary of {vocab_size} has no known tokenizer (mpicube knows "
                            f"bytes, 256, and GPT-2's BPE, 50257): give token ids with --prompt-tokens")
        tokenizer = tokenizers.load(tokenizer_name)
        ids = tokenizer.encode(opts.prompt) if opts.prompt is not None else list(tokenizer.start)
    if not ids:
        raise UserError("the prompt is empty: give at least one token")
    return ids, tokenizer


def last_logits(parts, logits) -> np.ndarray:
    """Row 0's logits at the last position, (V,) float64 on every rank,
    from each rank's (B_l, t, V_l) block (None on a pipeline stage
    without the head: it adds only -inf)."""
    layout, emb, backend = parts.layout, parts.model.embedding, parts.backend
    xp = backend.xp
    full = xp.full(layout.vocab_padded, -xp.inf, dtype=backend.dtype)    # (V_padded,)
    rows = np.flatnonzero(np.asarray(emb.logit_seqs) == 0) if logits is not None else np.zeros(0)
    if layout.axes.dp.rank == 0 and rows.size:
        start = emb.vocab_start
        full[start:start + logits.shape[-1]] = logits[int(rows[0]), -1]
    full = layout.axes.world.allreduce(full, "max")
    return np.asarray(backend.to_host(full)[:parts.cfg.vocab_size], dtype=np.float64)


class Generator:
    """A model loaded on this rank's share of a layout, ready to continue prompts."""

    def __init__(self, parts):
        self.parts = parts
        self.rows = parts.layout.local_batch        # this replica's sequences, all the same prompt

    def _sync(self) -> float:
        self.parts.backend.synchronize()
        return time.perf_counter()

    def run(self, prompt: list, max_new_tokens: int, sampler: Sampler, cache: bool = True) -> dict:
        """Continue ``prompt``; returns the new tokens and the time of the
        prefill and of each new token."""
        model = self.parts.model
        seq = list(prompt)
        new, step_times = [], []
        caches = model.new_caches(len(prompt) + max_new_tokens) if cache else None     # (B, nkv, T, hd) per block
        t0 = self._sync()
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            logits = self._forward(seq, 0, caches)
            prefill = self._sync() - t0
            for n in range(max_new_tokens):
                token = sampler(last_logits(self.parts, logits))
                new.append(token)
                seq.append(token)
                if n + 1 == max_new_tokens:
                    break
                t0 = self._sync()
                logits = self._forward(seq, len(seq) - 1, caches)
                step_times.append(self._sync() - t0)
        return {"tokens": new, "prefill_s": prefill, "step_times_s": step_times}

    def _forward(self, seq: list, pos: int, caches):
        """(B_l, t, V_l) logits of seq[pos:] (cached) or of all of seq."""
        model = self.parts.model
        if caches is not None:
            idx = np.tile(np.asarray(seq[pos:], dtype=np.int64), (self.rows, 1))       # (B_dp, t)
            return model.decode(idx, pos, caches)
        idx = np.tile(np.asarray(seq, dtype=np.int64), (self.rows, 1))                 # (B_dp, T)
        return model.full_logits(idx)


def load_generator(model_file, cfg, layout="auto", dp=1, depth=1, dtype="float32", device="cpu", tf32=False,
                   mpi_world=None, pp=1, pp_schedule="1f1b", virtual_stages=1, ep=1) -> Generator:
    """Build the smallest-batch model on this rank and read its blocks."""
    from ..parallel.gridspec import Plan
    from ..parallel.planning import resolve
    from ..training.parts import Numerics, build_parts
    from .common import env_settings

    plan = Plan(layout, dp=dp, depth=depth, pp=pp, pp_schedule=pp_schedule, virtual_stages=virtual_stages, ep=ep,
                **env_settings())
    run = resolve(plan, cfg, None, mpi_world.Get_size(), at_least=1)     # the smallest batch the plan takes
    parts = build_parts(run, mpi_world, Numerics(dtype, device, tf32))
    formats.load_params(model_file, parts.store)
    return Generator(parts)


def generate(opts: GenerateOptions, mpi_world) -> dict:
    """Run ``mpicube generate``; the result rank 0 prints."""
    opts.validate()
    with formats.open_everywhere(mpi_world, opts.model) as model_file:
        cfg, note = generation_config(model_file.config)
        source = model_file.describe()
        tokenizer_name = tokenizers.name_for(cfg.vocab_size)
        prompt, tokenizer = prompt_ids(opts, cfg.vocab_size, tokenizer_name)
        count, clip_note = new_token_count(opts.max_new_tokens, len(prompt), cfg.n_ctx)
        gen = load_generator(model_file, cfg, opts.layout, opts.dp, opts.depth, opts.dtype, opts.device, opts.tf32,
                             mpi_world, opts.pp, opts.pp_schedule, opts.virtual_stages, opts.ep)
    result = gen.run(prompt, count, Sampler(opts.temperature, opts.top_k, opts.seed), opts.cache)
    steps = result.pop("step_times_s")
    result.update({
        "prompt_tokens": prompt,
        "text": tokenizer.decode(result["tokens"]) if tokenizer is not None else None,
        "prompt_text": tokenizer.decode(prompt) if tokenizer is not None else None,
        "per_token_s": float(np.median(steps)) if steps else None,
        "cache": opts.cache,
        "model": source,
        "layout": gen.parts.layout.describe(),
        "note": "; ".join(n for n in (note, clip_note) if n) or None,
    })
    return result
