"""Every choice that shapes a run as one frozen value, the ``Plan``: which
tensor-parallel layout, how many data-parallel replicas, pipeline stages
and context-parallel ranks surround it, and the modes the builders follow
(ZeRO stage, recompute, gradient accumulation, overlap, attention kind).

Why one object: every entry point (train, eval, generate, bench, info,
trace, the tools) used to pass ``dp, depth``, the layout name, zero,
recompute and grad-accum as loose arguments, and read two switches
(``MPICUBE_OVERLAP``, ``MPICUBE_ATTENTION``) from the environment deep
inside the layouts and the model. Now the command line reads the
environment once (``cli/common.py`` ``env_settings``) into plan fields, so
two layouts with different settings can live in one process (``bench
--overlap-both``). A ``Plan`` is pure (no MPI): ``grid.resolve`` validates
it, once, against a world size, a model and a batch before any
communicator exists, and every builder takes the resolved plan it returns
without validating again. ``GridSpec`` is its former name, kept as an
alias.

Rank order, slowest-varying first: dp, pp, cp, tp.

    world rank = ((d * pp + p) * cp + c) * tp + t

* tp innermost: a tensor-parallel group makes the most, smallest and most
  latency-bound messages of any axis, so it sits on consecutive ranks, which
  schedulers place on one node (or the fewest nodes).
* cp next: the ring of K/V blocks is the second-heaviest traffic per layer.
* pp next: a stage boundary sends one activation shard per micro-batch to
  the rank with the same (d, c, t) in the neighbouring stage; consecutive
  stages of one replica are on neighbouring nodes.
* dp outermost: one model replica (pp x cp x tp ranks) is a contiguous
  block of ranks, so replicas are whole node blocks that communicate once
  per step (the gradient reduction, which overlaps backward), the traffic
  that tolerates the slowest links best. It also keeps the rank order of
  runs without pp and cp (``d * tp + t``) and so every existing run.

``sequence_parallel`` is no axis (no ranks of its own): it changes how the
1-D layout's tp group holds its activations (``layouts/seqpar.py``). It
lives here, not in a layout option, because it is chosen with the axes on
every entry point and ``grid.resolve`` must validate it against them (1-D
only, T/cp divisible by tp) before any communicator
exists; ``build_layout`` hands it to ``OneDLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import ConfigError


ATTENTION_KINDS = ("blocks", "full")   # blockwise (O(T) kept per head) or the whole (T, T) scores
CP_KINDS = ("ring", "ulysses", "hybrid")   # how the cp ranks share attention (parallel/context.py, ulysses.py)


@dataclass(frozen=True)
class Plan:
    """Every choice of a run as the user gave it; tp is what is left of the world."""

    layout: str = "auto"   # tensor-parallel layout name (layouts.LAYOUTS) or "auto"
    dp: int = 1            # data-parallel replicas
    pp: int = 1            # pipeline stages
    cp: int = 1            # context-parallel ranks (each holds 2 of 2*cp chunks of every sequence)
    depth: int = 1         # the 2.5-D layout's depth
    pp_schedule: str = "1f1b"   # the pipeline's schedule (parallel/schedules.py SCHEDULES)
    virtual_stages: int = 1     # model chunks per stage (interleaved schedule)
    sequence_parallel: bool = False   # 1-D only: canonical activations sharded along T (layouts/seqpar.py)
    zero: int = 0               # 1: optimizer state, 2: and gradients, 3: and weights sharded over dp
    recompute: str = "none"     # layouts/base.py RECOMPUTE_MODES: memory for communication and FLOPs
    grad_accum: int = 1         # micro-batches per step; the layout is built for one of them
    overlap: bool = True        # collectives overlapped with GEMMs (False: the blocking path, to compare)
    attention: str = "blocks"   # ATTENTION_KINDS: blockwise attention, or "full" (the (T, T) op)
    ep: int = 1                 # expert-parallel ranks, taken from dp (a mixture of experts; parallel/experts.py)
    cp_kind: str = "ring"       # CP_KINDS: K/V round a ring, heads by all-to-all (Ulysses), or both
    ulysses: int = 1            # --cp-kind hybrid: Ulysses group size (cp / ulysses ring steps)
    hsdp: int = 1               # --hsdp R: dp in R replicas of dp/R-way ZeRO-3 shard groups (parallel/hsdp.py)
    fp8: object = None          # --fp8: an ops.fp8_recipes.Recipe (every linear's GEMMs quantized), or None

    @classmethod
    def of(cls, value) -> "Plan":
        """A Plan from a Plan, or from a layout name (every other choice its default)."""
        if isinstance(value, Plan):
            return value
        if isinstance(value, str):
            return cls(layout=value)
        raise TypeError(f"expected a Plan or a layout name, got {value!r}")

    def but(self, **changes) -> "Plan":
        """This plan with some choices changed (the value itself is frozen)."""
        return replace(self, **changes)

    @property
    def outer(self) -> int:
        """Ranks per tensor-parallel position: dp x pp x cp."""
        return self.dp * self.pp * self.cp

    @property
    def ulysses_size(self) -> int:
        """cp ranks that trade sequence shards for head shards by all-to-all
        (U): all of cp under ulysses, --ulysses under hybrid, 1 for the ring.
        The ring then runs over cp / U groups."""
        return {"ulysses": self.cp, "hybrid": self.ulysses}.get(self.cp_kind, 1)

    def tp(self, world_size: int) -> int:
        """Tensor-parallel size for this world, or a ConfigError naming the
        sizes that would divide it."""
        for name in ("dp", "pp", "cp", "depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if world_size % self.outer:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            used = [f"--{n} {getattr(self, n)}" for n in ("dp", "pp", "cp") if getattr(self, n) != 1]
            if len(used) == 1:
                raise ConfigError(f"{used[0]} must divide the world size {world_size}; choose one of {divisors}")
            raise ConfigError(f"{' x '.join(used)} = {self.outer} must divide the world size {world_size}; "
                              f"their product must be one of {divisors}")
        return world_size // self.outer

    def coords(self, rank: int, world_size: int) -> tuple:
        """(d, p, c, t): this world rank's replica, stage, context rank and
        tensor-parallel rank (the order in the module docstring)."""
        tp = self.tp(world_size)
        rest, t = divmod(rank, tp)
        rest, c = divmod(rest, self.cp)
        d, p = divmod(rest, self.pp)
        return d, p, c, t

    def words(self) -> str:
        """The axes other than tp that are not 1, for a layout line: ', dp 2, pp 4 (1f1b)'."""
        out = ""
        for n in ("dp", "pp", "cp", "depth"):
            if getattr(self, n) != 1:
                out += f", {n} {getattr(self, n)}"
                if n == "dp" and self.hsdp > 1:
                    out += f" (hsdp {self.hsdp} x {self.dp // self.hsdp})"
                if n == "cp" and self.cp_kind != "ring":
                    out += f" ({self.cp_kind}" + (f" {self.ulysses}" if self.cp_kind == "hybrid" else "") + ")"
                if n == "pp":
                    v = f", V {self.virtual_stages}" if self.virtual_stages != 1 else ""
                    out += f" ({self.pp_schedule}{v})"
        return out


def hsdp_coords(d: int, dp: int, replicas: int) -> tuple:
    """(replica group, rank in it) of data-parallel rank ``d`` under --hsdp
    ``replicas``: shard groups of dp / R consecutive replicas (consecutive
    ranks share the faster links), the same position in each group forming
    the R-rank replica group. Pure: ``grid.build_layout`` splits by it and
    ``tools/hsdp_pictures.py`` draws it."""
    shards = dp // replicas
    return d // shards, d % shards


GridSpec = Plan   # the former name (when the value held the axes only)
