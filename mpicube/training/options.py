"""Every option of ``mpicube train`` as one dataclass, and the checks that
need no MPI (so every rank reaches the same verdict before the first
collective). The trainer (``mpicube.training.train``), ``trace`` and API callers
build runs from it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..files import data
from ..core.config import DEEPSEEK_OPTIONS, ModelConfig, family_fields
from ..core.errors import ConfigError
from ..model.families import family_of
from ..parallel.gridspec import Plan
from .loss_scale import scaler_for
from .parts import Numerics
from . import muon
from .fp8_options import fp8_recipe

MLA_OPTIONS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
               "mtp_depth", "mtp_loss_weight")
FP8_OPTIONS = ("fp8", "fp8_grad_format", "fp8_accumulate", "fp8_amax_history", "fp8_amax_rule", "fp8_block",
               "fp8_pow2")
MOE_OPTIONS = ("n_experts", "top_k", "no_norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef"
               ) + DEEPSEEK_OPTIONS


@dataclass
class TrainOptions:
    """Every option of ``mpicube train`` (same names as the command line)."""

    layout: str = "auto"
    dp: int = 1
    ep: int = 1                    # expert-parallel ranks taken from dp (a mixture of experts)
    pp: int = 1                    # pipeline stages
    pp_schedule: str = "1f1b"      # gpipe, 1f1b, interleaved, zb-h1, zbv or dualpipev (micro-batches: grad_accum)
    virtual_stages: int = 1        # model chunks per stage under interleaved
    cp: int = 1                    # context-parallel ranks (issue 22)
    cp_kind: str = "ring"          # ring, ulysses or hybrid (issue 46; parallel/ulysses.py)
    ulysses: int = 1               # hybrid's Ulysses group size
    hsdp: int = 1                  # --hsdp R: dp as R replicas of dp/R-way ZeRO-3 shard groups (issue 46)
    sequence_parallel: bool = False   # 1-D: LayerNorm/dropout/residual regions sharded along T (issue 22)
    depth: int = 1
    n_layer: int = 4
    n_head: int = 12
    n_embd: int = 144
    arch: str = "gpt2"             # gpt2 or llama (the rest of this group: llama's, None = its default)
    n_kv_head: Optional[int] = None
    ffn_hidden: Optional[int] = None
    rope_theta: Optional[float] = None
    rms_eps: Optional[float] = None
    tie_embeddings: bool = False
    n_experts: Optional[int] = None          # a mixture of experts (llama, mixtral; docs/moe.md); None = none
    top_k: Optional[int] = None
    no_norm_topk: bool = False
    capacity_factor: Optional[float] = None  # None = dropless
    router_aux_loss_coef: Optional[float] = None
    router_z_loss_coef: Optional[float] = None
    router: Optional[str] = None             # DeepSeekMoE's options (core.config.DEEPSEEK_MOE); None = default
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    routed_scaling_factor: Optional[float] = None
    n_shared_experts: Optional[int] = None
    moe_ffn_hidden: Optional[int] = None
    first_k_dense: Optional[int] = None
    bias_update_rate: Optional[float] = None
    bias_update: Optional[str] = None
    seq_aux_loss_coef: Optional[float] = None
    q_lora_rank: Optional[int] = None        # deepseek_v3's multi-head latent attention; None = its default
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_interleave: Optional[bool] = None
    mtp_depth: Optional[int] = None          # deepseek_v3's multi-token prediction (model/mtp.py); None = 0
    mtp_loss_weight: Optional[float] = None
    seq_len: int = 64
    vocab_size: int = data.VOCAB_SIZE   # a model given by --init-from or --resume brings its own
    batch_size: Optional[int] = None   # global sequences per step; None = the smallest of at least 8 that fits
    grad_accum: int = 1            # micro-batches per step (forward+backward each), one optimizer step
    steps: int = 500
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "adamw"       # adamw, sgd (plain SGD, a reference mode: training.optim.SGD) or muon
    muon_qkv: str = "split"        # --optimizer muon: q, k, v orthogonalised split or joint (training.muon)
    dropout: float = 0.0
    seed: int = 1337
    dtype: str = "float32"
    device: str = "cpu"
    tf32: bool = False             # GPU float32 GEMMs on tensor cores
    recompute: str = "none"        # none, gathers or blocks: memory for communication and FLOPs
    loss_scale: Optional[float] = None                 # float16: initial loss scale (None = default)
    loss_scale_growth_interval: Optional[int] = None   # float16: good steps before the scale doubles
    loss_scale_backoff: Optional[float] = None         # float16: factor applied on overflow
    data: Optional[str] = None     # train shard; None = built-in corpus
    val_data: Optional[str] = None  # validation shard; None = the train shard's <stem>_val sibling, if any
    out: Optional[str] = None      # run directory; None = runs/<timestamp>
    ckpt_every: int = 0            # 0 = only the final checkpoint
    keep: int = 3                  # 0 = keep every checkpoint
    eval_every: int = 0            # 0 = no evaluation
    eval_batches: int = 8
    log_every: int = 10
    init_from: Optional[str] = None
    resume: bool = False
    force_unlock: bool = False     # take the run directory's lock from a job on another host
    stop_after: Optional[int] = None
    time_limit: Optional[float] = None
    zero: int = 0                  # 1: AdamW state (and 16-bit runs' master weights) sharded over dp
    overlap: bool = True           # collectives overlapped with GEMMs (the CLI: off under MPICUBE_OVERLAP=0)
    attention: str = "blocks"      # blockwise attention, or "full" (the CLI: MPICUBE_ATTENTION=full)
    fp8: Optional[str] = None      # an FP8 recipe for every linear's GEMMs (ops/fp8_recipes.py RECIPES), or None
    fp8_grad_format: Optional[str] = None   # e4m3 or e5m2 for dy; None = the recipe's
    fp8_accumulate: Optional[str] = None    # float32 or float64; None = --dtype's
    fp8_amax_history: int = 16     # delayed: steps of amax history
    fp8_amax_rule: str = "max"     # delayed: the history's max, or its most recent
    fp8_block: Optional[int] = None   # blockwise/mxfp8: tile length; None = the recipe's (128, 32)
    fp8_pow2: bool = False         # rowwise: scales rounded down to powers of two

    def to_dict(self) -> dict:
        """Every option; a GPT-2 run leaves out the Llama family's (all at their
        defaults), so its config.json and checkpoints read as before they existed."""
        d = asdict(self)
        if self.optimizer != "muon" and self.muon_qkv == "split":   # stored as before Muon existed
            d.pop("muon_qkv")
        if self.hsdp == 1:                                  # stored as before --hsdp existed
            d.pop("hsdp")
        if self.cp_kind == "ring" and self.ulysses == 1:   # stored as before the Ulysses options existed
            d.pop("cp_kind"), d.pop("ulysses")
        if self.arch == "gpt2":
            for key in ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "rms_eps", "tie_embeddings"):
                d.pop(key)
        if self.arch == "gpt2" or not self.model_config().moe:      # stored as before the MoE options existed
            for key in MOE_OPTIONS + ("ep",):
                d.pop(key)
        for key in DEEPSEEK_OPTIONS:                               # stored as before DeepSeek's options existed
            if d.get(key, 0) is None:
                d.pop(key)
        if self.arch != "deepseek_v3":                               # stored as before the MLA options existed
            for key in MLA_OPTIONS:
                d.pop(key)
        if self.fp8 is None:                                        # stored as before --fp8 existed
            for key in FP8_OPTIONS:
                d.pop(key)
        return d

    def fp8_recipe(self):
        """--fp8's Recipe (ops/fp8_recipes.py), or None; ConfigError for
        a combination it cannot run (pure: every rank agrees)."""
        return fp8_recipe(self.fp8, self.dtype, grad_format=self.fp8_grad_format, accumulate=self.fp8_accumulate,
                          history=self.fp8_amax_history, rule=self.fp8_amax_rule, block=self.fp8_block,
                          power_of_2=self.fp8_pow2)

    def family(self) -> dict:
        """``family_fields``' keyword arguments from these options."""
        return dict(arch=self.arch, n_kv_head=self.n_kv_head, ffn_hidden=self.ffn_hidden, rope_theta=self.rope_theta,
                    rms_eps=self.rms_eps, tie_embeddings=self.tie_embeddings,
                    **{k: getattr(self, k) for k in MOE_OPTIONS + MLA_OPTIONS})

    @property
    def plan(self) -> Plan:
        """Every choice that shapes the run, as one value (parallel/gridspec.py);
        ``parallel.planning.resolve`` validates it, once per launch."""
        return Plan(layout=self.layout, dp=self.dp, pp=self.pp, cp=self.cp, depth=self.depth,
                    pp_schedule=self.pp_schedule, virtual_stages=self.virtual_stages,
                    sequence_parallel=self.sequence_parallel, zero=self.zero, recompute=self.recompute,
                    grad_accum=self.grad_accum, overlap=self.overlap, attention=self.attention, ep=self.ep,
                    cp_kind=self.cp_kind, ulysses=self.ulysses, hsdp=self.hsdp,
                    fp8=self.fp8_recipe())

    grid = plan     # the former name

    @property
    def numerics(self) -> Numerics:
        """Where and in which format the model computes."""
        return Numerics(self.dtype, self.device, self.tf32)

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, n_ctx=self.seq_len, n_layer=self.n_layer,
                           n_head=self.n_head, n_embd=self.n_embd,
                           **family_fields(**self.family()))

    @property
    def file_decides_family(self) -> bool:
        """A model file (--init-from, --resume's checkpoint) decides the
        family unless --arch was given: the family options are checked
        against it, not against GPT-2's default (``given_shape``, set by the
        command line, names the options typed; API callers give all)."""
        given = getattr(self, "given_shape", None)
        return given is not None and "arch" not in given and (self.init_from is not None or self.resume)

    @property
    def last_step(self) -> int:
        """The step this invocation stops after (the schedule still spans ``steps``)."""
        return self.steps if self.stop_after is None else min(self.steps, self.stop_after)

    def validate(self) -> None:
        """Raise ConfigError for a bad value of an option outside the plan;
        pure, so every rank agrees. The plan's choices (axes, zero,
        recompute, their combinations) and the model's sizes are validated
        once, by ``parallel.planning.resolve``, when the model is known."""
        positive = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "batch_size", "steps", "dp", "pp", "cp", "depth",
                    "eval_batches", "log_every", "grad_accum")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{_dash(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "ckpt_every", "keep", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_dash(name)} must be 0 or more, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{_dash(name)} must be a finite number >= 0, got {value}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64:
            raise ConfigError(f"--seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        if self.optimizer not in ("adamw", "sgd", "muon"):
            raise ConfigError(f"--optimizer must be adamw, sgd or muon, got {self.optimizer!r}")
        if self.optimizer == "muon":
            muon.check(self.model_config(), self.muon_qkv)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"--stop-after must be at least 1, got {self.stop_after}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ConfigError(f"--time-limit must be positive (seconds), got {self.time_limit}")
        self.loss_scaler()
        self.fp8_recipe()
        if self.file_decides_family:       # checked against the model file's family once it is open
            return
        family_fields(**self.family())
        cfg = self.model_config()        # Llama's --n-kv-head dividing --n-head, an even head size: before any file
        family_of(cfg).check(cfg)

    def loss_scaler(self):
        """A fresh LossScaler for --dtype float16, else None (ConfigError for
        loss-scale options with another format)."""
        return scaler_for(self.dtype, self.loss_scale, self.loss_scale_growth_interval, self.loss_scale_backoff)


def _dash(name: str) -> str:
    return name.replace("_", "-")
