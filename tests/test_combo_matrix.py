"""Every axis composes with every other (issue 32, item 4): a pairwise
covering set of combinations of layout x dp x pp (schedule) x cp x
sequence parallelism x zero x recompute x grad-accum x dtype, each equal to
serial (float64 1e-10 with dropout; 16 bits at parallel_check's
tolerance) with each rank's bytes, messages and memory equal to the cost
model (tests/combo_matrix_check.py says what is compared).

Why pairwise: the bugs an equivalence checker finds sit in compositions
of two axes far more often than of three, and every pair of setting
values (1d with zero 3, interleaved with float16, cp with --recompute
blocks, ...) appears in some case here, at 34 cases instead of the
full product's thousands. The set is chosen by a small deterministic
greedy algorithm (``covering_set``, then redundant cases dropped) from
the runnable combinations, so a new axis value or a lifted refusal
changes the set by itself; the test prints it.

Cost: the cases are grouped by world size and each world size is ONE
mpiexec launch (MPI start-up and imports paid once, the serial reference
computed once per model and dtype per rank), with a tiny model (2 layers,
n_embd 16, 4 heads, 16 positions, batch 8).

The refusals of today are one line (``REFUSED``): when a pairing is
lifted, delete its entry and the generator covers its pairs. The 4-axis
case (1-D tp 2 x pp 2 x cp 2 x dp 2 with zero 3) runs once none of its
pairings is refused, and is skipped with the reason until then.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections import defaultdict

import pytest

from mpirun import mpiexec

# --- the axes ------------------------------------------------------------------------

# layout -> (tp, depth): the smallest grid on which each layout communicates
# (2-D and 3-D q 2, 2.5-D q 2 with depth 2, 1-D p 2).
LAYOUTS = {"serial": (1, 1), "1d": (2, 1), "2d": (4, 1), "2.5d": (8, 2), "3d": (8, 1)}
# pp value -> (stages, schedule, virtual stages): interleaved runs 2 chunks a stage (4 layers)
PIPELINES = {"none": (1, "1f1b", 1), "gpipe": (2, "gpipe", 1), "1f1b": (2, "1f1b", 1),
             "interleaved": (2, "interleaved", 2)}
AXES = {
    "layout": list(LAYOUTS),
    "dp": [1, 2],
    "pp": list(PIPELINES),
    "cp": [1, 2],
    "sp": [False, True],
    "zero": [0, 1, 2, 3],
    "recompute": ["none", "gathers", "blocks"],
    "accum": [1, 2],
    "dtype": ["float64", "float16", "bfloat16"],
}
MAX_WORLD = 16          # more ranks than this on CI's 2 cores costs more than the pairs are worth

# When each pairing is in play (the words REFUSED uses).
ACTIVE = {
    "pp": lambda c: c["pp"] != "none",
    "cp": lambda c: c["cp"] > 1,
    "sequence_parallel": lambda c: c["sp"],
    "zero23": lambda c: c["zero"] >= 2,
}
# Pairings this build refuses (parallel/planning.py validate_axes, check_sequence_parallel; parallel/zero.py
# validate): delete an entry when its pairing lands (branches ppcp and zerocomp), and the matrix covers it.
REFUSED = set()        # every pairing composes (pp x cp, sequence parallel x pp/cp, zero 2/3 x pp/cp lifted)

FOUR_AXES = {"layout": "1d", "dp": 2, "pp": "1f1b", "cp": 2, "sp": False, "zero": 3, "recompute": "none",
             "accum": 2, "dtype": "float64"}


def refused_by(combo: dict) -> list:
    """The REFUSED pairings ``combo`` uses (empty: it may run)."""
    return sorted(f"{a} x {b}" for a, b in REFUSED if ACTIVE[a](combo) and ACTIVE[b](combo))


def world(combo: dict) -> int:
    return LAYOUTS[combo["layout"]][0] * combo["dp"] * PIPELINES[combo["pp"]][0] * combo["cp"]


def runnable(combo: dict) -> bool:
    """What can run by construction (not a refusal: no build could run it)
    and is not refused today: sequence parallelism is 1-D's, ZeRO shards
    over dp, the interleaved schedule runs micro-batches in groups of pp."""
    if combo["sp"] and combo["layout"] != "1d":
        return False
    if combo["zero"] and combo["dp"] < 2:
        return False
    if PIPELINES[combo["pp"]][1] == "interleaved" and combo["accum"] % PIPELINES[combo["pp"]][0]:
        return False
    return world(combo) <= MAX_WORLD and not refused_by(combo)


def pairs_of(combo: dict) -> set:
    """Every (axis, value, axis, value) pair the combination exercises."""
    items = [(axis, combo[axis]) for axis in AXES]
    return {a + b for a, b in itertools.combinations(items, 2)}


def covering_set() -> list:
    """Greedy pairwise covering: among the runnable combinations, take the
    one that covers the most pairs not yet covered (ties: fewer ranks, then
    the first in AXES order), until every pair that some runnable
    combination exercises is covered. Deterministic: the same set on every
    machine, printed by the test."""
    names = list(AXES)
    candidates = [c for c in (dict(zip(names, v)) for v in itertools.product(*AXES.values())) if runnable(c)]
    pairs = [pairs_of(c) for c in candidates]
    todo = set().union(*pairs)
    chosen = []
    while todo:
        best = max(range(len(candidates)), key=lambda i: (len(pairs[i] & todo), -world(candidates[i]), -i))
        chosen.append(candidates[best])
        todo -= pairs[best]
    # Greedy leaves cases whose pairs the later ones came to cover too: drop
    # them, last first (each is a launch's worth of time, or a whole launch).
    for combo in reversed(list(chosen)):
        others = [c for c in chosen if c is not combo]
        if pairs_of(combo) <= set().union(*(pairs_of(c) for c in others)):
            chosen = others
    return chosen


def resolved_words(combo: dict) -> str:
    """The combination as combo_matrix_check's words, with the smallest batch
    of at least 8 the plan accepts (planning.resolve chooses it, as train
    does without --batch-size) and 4 layers under the interleaved schedule
    (2 chunks on each of 2 stages)."""
    from mpicube.core.config import ModelConfig
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve

    tp, depth = LAYOUTS[combo["layout"]]
    pp, schedule, virtual = PIPELINES[combo["pp"]]
    layers = 2 * virtual
    plan = Plan(combo["layout"], dp=combo["dp"], pp=pp, cp=combo["cp"], depth=depth, pp_schedule=schedule,
                virtual_stages=virtual, sequence_parallel=combo["sp"], zero=combo["zero"],
                recompute=combo["recompute"], grad_accum=combo["accum"])
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=layers, n_head=4, n_embd=16)
    batch = resolve(plan, cfg, None, world(combo)).batch_size
    return (f"layout={combo['layout']} tp={tp} depth={depth} dp={combo['dp']} pp={pp} schedule={schedule} "
            f"virtual={virtual} cp={combo['cp']} sp={int(combo['sp'])} zero={combo['zero']} "
            f"recompute={combo['recompute']} accum={combo['accum']} dtype={combo['dtype']} layers={layers} "
            f"batch={batch}")


# Llama (issue 33): each joins its world size's launch. 8 heads over kv= kv heads;
# a head split finer than kv (1-D tp 4 and 8 over 2, 2-D/2.5-D/3-D q 2 over 1)
# replicates kv heads over the ranks that share them, the others hold whole ones.
# Each is checked like every case: against serial, and its traffic and memory
# against the cost model's Llama terms.
LLAMA = "arch=llama heads=8"
LLAMA_CASES = [
    (4, f"layout=1d tp=4 kv=2 recompute=blocks accum=2 {LLAMA}"),              # replicated (2 ranks a kv head)
    (4, f"layout=2d tp=4 kv=2 {LLAMA}"),                                       # whole kv heads on the grid
    (8, f"layout=1d tp=8 kv=2 recompute=gathers ckpt=1 {LLAMA}"),              # replicated (4 ranks a kv head)
    (8, f"layout=3d tp=8 kv=1 ckpt=1 {LLAMA}"),                                # replicated over j
    (8, f"layout=3d tp=8 kv=2 {LLAMA}"),                                       # whole kv heads on the cube
    (8, f"layout=2d tp=4 dp=2 zero=3 kv=1 {LLAMA}"),                           # replicated over columns, zero 3
    (8, f"layout=2.5d tp=8 depth=2 kv=1 {LLAMA}"),                             # replicated, summed over depth too
    (8, f"layout=1d tp=4 cp=2 kv=2 {LLAMA}"),                                  # rotary at ring positions
    (8, f"layout=1d tp=4 pp=2 accum=2 kv=2 {LLAMA}"),                          # untied head on the last stage
    (8, f"layout=1d tp=4 sp=1 dp=2 zero=2 kv=2 {LLAMA}"),                      # sequence parallel, zero 2
    (8, f"layout=1d tp=4 dp=2 zero=1 kv=1 {LLAMA}"),                           # zero 1's chunked norm
    (8, f"layout=1d tp=2 cp=2 dp=2 kv=2 {LLAMA}"),                             # whole kv heads, cp with dp
    (8, f"layout=3d tp=8 kv=1 dtype=bfloat16 {LLAMA}"),                        # the kv sums on the 16-bit wire
]


# Zero-bubble schedules (issue 46 item 2: ZB-H1, ZBV, DualPipeV): each joins its world size's launch;
# B and W split at the linears (parallel/wgrad.py), against serial with dropout, traffic and the cost
# model's peak of tapes and filed weight phases per stage, on tensor-parallel layouts with dp, zero 1,
# cp, sp, recompute, a 16-bit format and Llama's untied head (on stage 0 in a V).
ZB_CASES = [
    (4, "layout=1d tp=2 pp=2 schedule=zb-h1 accum=2 dtype=bfloat16 batch=8"),
    (8, "layout=1d tp=2 dp=2 pp=2 schedule=zbv virtual=2 layers=4 zero=1 accum=4 recompute=blocks batch=16"),
    (8, "layout=2d tp=4 pp=2 schedule=dualpipev virtual=2 layers=4 accum=4 batch=8"),
    (8, "layout=1d tp=2 pp=2 cp=2 sp=1 schedule=zb-h1 accum=2 recompute=gathers batch=8"),
    (8, f"layout=1d tp=4 pp=2 schedule=zbv virtual=2 layers=4 accum=2 kv=2 {LLAMA}"),
    (16, "layout=3d tp=8 pp=2 schedule=zb-h1 accum=2 batch=8"),                  # the cube's deferred W
    (16, "layout=2.5d tp=8 depth=2 pp=2 schedule=zbv virtual=2 layers=4 accum=2 batch=16"),
]


# FP8 (issue 45): each joins its world size's launch; 3 steps in float64, equal to
# serial to 1e-12. Tiles of 4 (--fp8-block) so the small model's shards hold whole ones.
FP8_CASES = [
    (4, "layout=1d tp=4 fp8=tensorwise steps=3"),
    (4, "layout=1d tp=2 dp=2 fp8=rowwise steps=3"),
    (4, "layout=1d tp=4 sp=1 fp8=blockwise fp8block=4 steps=3"),
    (4, "layout=1d tp=2 cp=2 fp8=mxfp8 fp8block=4 steps=3"),
    (4, "layout=2d tp=4 fp8=delayed steps=3"),
    (4, "layout=2d tp=4 recompute=gathers fp8=tensorwise steps=3"),          # panels gathered again in backward
    (4, "layout=1d tp=2 dp=2 zero=3 recompute=blocks fp8=tensorwise steps=3"),   # gathered weights, rerun blocks
    (8, "layout=3d tp=8 fp8=tensorwise steps=3"),
    (8, "layout=3d tp=8 recompute=gathers fp8=delayed steps=3"),
    (8, "layout=2.5d tp=8 depth=2 fp8=delayed steps=3"),
    (8, f"layout=1d tp=4 pp=2 accum=2 kv=4 fp8=rowwise steps=3 {LLAMA}"),
    (8, "layout=1d tp=2 dp=2 cp=2 zero=1 fp8=blockwise fp8block=4 steps=3"),
    (8, f"layout=1d tp=4 dp=2 kv=4 fp8=mxfp8 fp8block=2 steps=3 {LLAMA}"),      # a kv head is 2 columns
    # Mixtral's experts (4, top 2): an expert's token rows come in any number (a short last tile)
    (4, f"layout=1d tp=4 kv=4 experts=4 fp8=mxfp8 fp8block=2 steps=3 {LLAMA}"),
    (4, f"layout=2d tp=4 kv=2 experts=4 fp8=delayed steps=3 {LLAMA}"),
    (4, f"layout=1d tp=2 dp=2 kv=2 experts=4 fp8=rowwise steps=3 {LLAMA}"),   # every expert runs on every replica
    # --ep: an expert's amaxes over the ranks holding it (its expert-data group and their tp ranks); a tile
    # recipe where one ep group spans dp (the expert's rank receives its rows in serial's token order)
    (4, f"layout=1d tp=2 dp=2 ep=2 kv=2 experts=4 fp8=tensorwise steps=3 {LLAMA}"),
    (4, f"layout=1d tp=2 dp=2 ep=2 kv=2 experts=4 fp8=blockwise fp8block=2 steps=3 {LLAMA}"),
    (4, "layout=1d tp=2 dp=2 ep=2 experts=8 fp8=mxfp8 fp8block=2 steps=3 arch=deepseek_v3"),
    (8, f"layout=1d tp=2 dp=4 ep=2 kv=2 experts=4 fp8=delayed steps=3 {LLAMA}"),   # two expert-data replicas
    (8, f"layout=2d tp=4 dp=2 ep=2 kv=2 experts=4 fp8=rowwise steps=3 {LLAMA}"),   # wgrad rows over a grid column
    (8, f"layout=1d tp=2 dp=2 cp=2 ep=2 kv=2 experts=4 fp8=rowwise steps=3 {LLAMA}"),   # ep folded into dp x cp
    (16, f"layout=3d tp=8 dp=2 ep=2 kv=2 experts=4 fp8=tensorwise steps=3 {LLAMA}"),  # the cube's experts' holders
    (16, f"layout=2.5d tp=8 depth=2 dp=2 ep=2 kv=2 experts=4 fp8=rowwise steps=3 {LLAMA}"),
    # the tile recipes on 2-D, 2.5-D and 3-D: each rank quantizes its own shard along each GEMM's contraction
    # before the panel travels; rowwise on 2-D with its row amaxes over the grid's rows, columns and cp
    (4, "layout=2d tp=4 fp8=blockwise fp8block=4 steps=3"),
    (8, "layout=2.5d tp=8 depth=2 fp8=mxfp8 fp8block=4 steps=3"),
    (8, "layout=3d tp=8 fp8=blockwise fp8block=4 steps=3"),
    (8, "layout=3d tp=8 recompute=gathers fp8=mxfp8 fp8block=4 steps=3"),
    (8, "layout=2d tp=4 cp=2 fp8=rowwise steps=3"),
    # rowwise on 3-D: a row's amax over a line (x, dy) or a plane (W) of the cube, wgrad's over a plane
    (8, "layout=3d tp=8 recompute=blocks fp8=rowwise steps=3"),
    # DeepSeek-V3's REPLICATED latent projections: every rank quantizes the whole W it holds and keeps its rows
    (4, "layout=1d tp=2 dp=2 fp8=mxfp8 fp8block=2 steps=3 arch=deepseek_v3"),
    (4, "layout=2d tp=4 fp8=rowwise steps=3 arch=deepseek_v3"),             # x's rows over the hidden split
    # DeepSeekMoE over dp under delayed scaling: an expert that gets no token runs anyway, on every layout and
    # serial alike (Layout.fp8_every), so its W's quantization and amax histories are serial's
    (4, "layout=1d tp=2 dp=2 fp8=delayed steps=3 experts=8 layers=3 arch=deepseek_v3"),
    # the cost model's remaining FP8 terms (analysis/costfp8.py): rowwise under sequence parallelism (a
    # replicated linear's token rows over the stage), MLA's replicated linears under a tensor scale with
    # their forward rerun, an expert's row amaxes and second gathers on the cube
    (4, "layout=1d tp=4 sp=1 fp8=rowwise steps=3 arch=deepseek_v3"),
    (4, "layout=2d tp=4 recompute=blocks fp8=tensorwise steps=3 arch=deepseek_v3"),
    (8, f"layout=3d tp=8 kv=2 experts=4 recompute=blocks fp8=rowwise steps=3 {LLAMA}"),
]


def test_fp8_cases_cover_every_recipe_and_layout():
    """Issue 45: every recipe runs on some layout against serial, the
    tile ones (and the tensor-scaled) on 2-D, 2.5-D and 3-D too, and the axes a scale
    must be reduced over (dp, cp, sequence parallelism, pp) each appear; every recipe
    also under --ep > 1."""
    words = [dict(w.split("=", 1) for w in ws.split()) for _, ws in FP8_CASES]
    from mpicube.ops.fp8_recipes import RECIPES

    assert {kw["fp8"] for kw in words} == set(RECIPES)
    assert {kw["layout"] for kw in words} == {"1d", "2d", "2.5d", "3d"}
    for axis in ("dp", "cp", "sp", "pp"):
        assert any(axis in kw for kw in words), axis
    assert all(kw["steps"] == "3" for kw in words)
    assert any("experts" in kw for kw in words)
    assert {kw["fp8"] for kw in words if int(kw.get("ep", 1)) > 1} >= {"tensorwise", "delayed", "rowwise",
                                                                      "blockwise", "mxfp8"}
    for layout in ("2d", "2.5d", "3d"):             # the tile recipes on every panel layout
        assert {kw["fp8"] for kw in words if kw["layout"] == layout} & {"blockwise", "mxfp8"}, layout
    assert {kw["layout"] for kw in words if kw["fp8"] == "rowwise"} >= {"1d", "2d", "3d"}
    # every path of the FP8 cost model, whose traffic every case checks: rowwise under sp, MLA's replicated
    # linears and a mixture's experts under a tensor and a row scale
    assert any(kw["fp8"] == "rowwise" and kw.get("sp") == "1" for kw in words)
    for kind in ("arch", "experts"):
        scales = {kw["fp8"] for kw in words if kind in kw and (kind != "arch" or kw[kind] == "deepseek_v3")}
        assert scales & {"tensorwise", "delayed"} and "rowwise" in scales, kind


# Ulysses and hybrid context parallelism (issue 46): each joins its world size's launch, checked like
# every case (serial to 1e-10 with dropout, traffic on the "ulysses" and "cp" axes and memory against the
# cost model). Every layout, GQA with kv heads replicated over the Ulysses ranks, rotary at the group's
# positions, sequence parallelism, zero 3, a pipeline, recompute with accumulation, the 16-bit wire.
CP_KIND_CASES = [
    (4, "layout=1d tp=2 cp=2 cpkind=ulysses batch=8"),
    (4, "layout=serial tp=1 cp=4 cpkind=hybrid ulysses=2 recompute=blocks accum=2 batch=8"),
    (8, "layout=2d tp=4 cp=2 cpkind=ulysses batch=8"),
    (8, f"layout=1d tp=2 cp=4 cpkind=ulysses kv=2 {LLAMA}"),                    # 4 Ulysses ranks over 2 kv heads
    (8, "layout=1d tp=2 cp=4 sp=1 cpkind=hybrid ulysses=2 dtype=bfloat16 batch=8"),
    (8, "layout=1d tp=2 cp=2 dp=2 zero=3 cpkind=ulysses batch=8"),
    (8, "layout=1d tp=2 pp=2 cp=2 accum=2 cpkind=ulysses batch=8"),
    (16, "layout=3d tp=8 cp=2 cpkind=ulysses batch=8"),
    (16, "layout=2.5d tp=8 depth=2 cp=2 cpkind=ulysses batch=8"),
]

# --optimizer muon (issue 46): Newton-Schulz on whole matrices gathered from every layout and ZeRO stage,
# equal to the serial Muon (which tests/test_muon.py checks against an independent PyTorch Muon), with the
# gathers' traffic in the cost model. ZeRO 3 on each layout; 1 and 2 with a pipeline, cp (Ulysses), GQA.
MUON_CASES = [
    (4, "layout=1d tp=2 dp=2 zero=3 opt=muon batch=8"),
    (4, "layout=2d tp=4 opt=muon qkv=joint batch=8"),
    (8, "layout=2d tp=4 dp=2 zero=3 opt=muon qkv=joint batch=8"),
    (8, "layout=1d tp=2 pp=2 dp=2 zero=2 accum=2 opt=muon batch=8"),
    (8, f"layout=1d tp=8 kv=2 opt=muon {LLAMA}"),                              # kv heads replicated over 4 ranks
    (8, "layout=1d tp=2 cp=2 dp=2 zero=1 cpkind=ulysses opt=muon batch=8"),
    (8, "layout=2.5d tp=8 depth=2 opt=muon dtype=bfloat16 batch=16"),
    (16, "layout=3d tp=8 dp=2 zero=3 opt=muon batch=8"),
    (16, "layout=2.5d tp=8 depth=2 dp=2 zero=3 opt=muon batch=16"),
]

# --hsdp R (issue 46): ZeRO-3 inside dp/R shard groups, the chunks all-reduced over the R replicas (axis
# hsdp), with a pipeline, cp, Muon, recompute and the 16-bit wire; traffic and memory against the cost model.
HSDP_CASES = [
    (4, "layout=serial tp=1 dp=4 zero=3 hsdp=2 dtype=bfloat16 batch=8"),
    (8, "layout=1d tp=2 dp=4 zero=3 hsdp=2 opt=muon batch=8"),
    (8, "layout=serial tp=1 pp=2 dp=4 zero=3 hsdp=2 accum=2 batch=8"),
    (8, "layout=serial tp=1 cp=2 dp=4 zero=3 hsdp=2 recompute=blocks batch=8"),
]


# DeepSeek-V3's multi-head latent attention (issue 43; dense MLP, or experts=): each joins its world size's launch,
# checked against serial to 1e-10 with dropout, and (not yet with mtp=) against the cost model.
# The latents replicated (on 2-D, 2.5-D and 3-D split as the hidden size before the up-projections), the
# heads split as each layout splits them with k_pe moved to their rows and its gradient summed over them
# (Layout.shared_key), sequence parallelism, a pipeline,
# the cp ring and Ulysses (rotary at global positions), zero 1-3, recompute, the 16-bit wire, q_proj (qrank=0);
# mtp= multi-token prediction depths (model/mtp.py) on half of them, a mixture's block among them under experts=.
DEEPSEEK = "arch=deepseek_v3"
# the issue's training target: the aux-loss-free bias update (bias=1) and MTP on for 5 steps, equal to serial
# (the biases bit for bit after every step, so the same for ep 1, 2 and 4: one serial reference for all
# the layers=3 cases) on 3-D (and 3-D x ep in the world-16 launch), 2-D x ep, 1-D x pp x ep, cp, zero 3
BIASED = f"bias=1 steps=5 qrank=8 {DEEPSEEK}"      # qrank 8: the cube splits the q latent 4 ways
DEEPSEEK_CASES = [
    (4, f"layout=1d tp=4 recompute=blocks accum=2 {DEEPSEEK}"),
    (4, f"layout=1d tp=2 pp=2 accum=2 mtp=2 {DEEPSEEK}"),         # MTP on the last stage, wte summed
    (4, f"layout=1d tp=2 cp=2 mtp=2 {DEEPSEEK}"),                  # depth tokens shifted, then cut
    (4, f"layout=1d tp=2 dp=2 zero=3 qrank=0 mtp=1 {DEEPSEEK}"),
    (4, f"layout=serial tp=1 dp=2 cp=2 zero=2 {DEEPSEEK}"),
    (8, f"layout=1d tp=4 dp=2 zero=1 recompute=gathers {DEEPSEEK}"),
    (8, f"layout=1d tp=2 cp=2 dp=2 qrank=0 {DEEPSEEK}"),
    (8, f"layout=1d tp=4 pp=2 accum=2 {DEEPSEEK}"),
    (8, f"layout=1d tp=2 cp=4 cpkind=ulysses heads=8 {DEEPSEEK}"),
    (8, f"layout=1d tp=4 dp=2 dtype=bfloat16 {DEEPSEEK}"),
    (4, f"layout=2d tp=4 recompute=gathers mtp=2 {DEEPSEEK}"),     # latents split as the hidden size
    (4, f"layout=1d tp=4 sp=1 recompute=gathers mtp=1 {DEEPSEEK}"),      # k_pe gathered, its gradient scattered
    (4, f"layout=1d tp=2 sp=1 cp=2 qrank=0 {DEEPSEEK}"),
    (8, f"layout=2.5d tp=8 depth=2 recompute=blocks batch=16 mtp=2 {DEEPSEEK}"),
    (8, f"layout=2d tp=4 dp=2 zero=3 mtp=1 {DEEPSEEK}"),
    (8, f"layout=2d tp=4 cp=2 qrank=0 {DEEPSEEK}"),
    (8, f"layout=2d tp=4 pp=2 accum=2 {DEEPSEEK}"),
    (8, f"layout=3d tp=8 qrank=8 mtp=1 {DEEPSEEK}"),                      # k_pe moved to the heads' rows
    (8, f"layout=3d tp=8 qrank=0 recompute=gathers mtp=1 {DEEPSEEK}"),  # each depth's head gathers lm_head again
    # with DeepSeekMoE after the first block (combo_matrix_check.DEEPSEEK_MOE: sigmoid router, 8 experts in 4
    # groups, top 2 within 2, a shared expert, the sequence-wise loss), the experts over ep of the dp replicas
    (4, f"layout=1d tp=2 dp=2 ep=2 experts=8 layers=3 mtp=1 {BIASED}"),
    (8, f"layout=2d tp=4 dp=2 ep=2 experts=8 layers=3 mtp=1 {BIASED}"),
    (8, f"layout=1d tp=2 dp=2 ep=2 pp=2 accum=2 experts=8 layers=4 mtp=1 {BIASED}"),
    (8, f"layout=3d tp=8 experts=8 layers=3 mtp=1 {BIASED}"),             # the router's columns split 2 ways
    (16, f"layout=3d tp=8 dp=2 ep=2 experts=8 layers=3 mtp=1 {BIASED}"),  # the issue's 3-D x ep
    (4, f"layout=1d tp=2 cp=2 experts=8 layers=3 mtp=1 {BIASED}"),
    (4, f"layout=serial tp=1 dp=4 ep=2 zero=3 experts=8 layers=3 mtp=1 {BIASED}"),
    (8, f"layout=1d tp=2 dp=4 ep=4 experts=8 layers=3 mtp=1 {BIASED}"),
    # without MTP, so that their traffic and memory meet the cost model for the routing they recorded
    # (combo_matrix_check checks both): the sigmoid router's tape, the shared experts, the dense first block
    (4, f"layout=2d tp=4 recompute=gathers experts=8 layers=3 {DEEPSEEK}"),
    (4, f"layout=1d tp=2 cp=2 sp=1 ep=2 experts=8 layers=3 {DEEPSEEK}"),     # the sequence-wise loss's ring sum
    (8, f"layout=2.5d tp=8 depth=2 batch=16 recompute=blocks experts=8 layers=3 {DEEPSEEK}"),
    # one dense and one mixture block: ZeRO's two gradient slots differ in width (block k uses slot k mod 2);
    # in bfloat16 an expert gets no token, so its gradient is exactly zero on both sides
    (4, f"layout=1d tp=2 dp=2 ep=2 zero=2 dtype=bfloat16 experts=8 layers=2 {DEEPSEEK}"),
]


def launches() -> dict:
    """{world size: [case words]}: the covering set grouped by world size,
    with the 4-axis case once no pairing of it is refused, the Llama cases,
    the Ulysses, Muon, HSDP, FP8 and DeepSeek-V3 cases."""
    groups = defaultdict(list)
    for combo in covering_set() + ([FOUR_AXES] if not refused_by(FOUR_AXES) else []):
        groups[world(combo)].append(resolved_words(combo))
    for ranks, words in (LLAMA_CASES + CP_KIND_CASES + MUON_CASES + HSDP_CASES + FP8_CASES + DEEPSEEK_CASES
                         + ZB_CASES):
        groups[ranks].append(words)
    return dict(sorted(groups.items()))


def describe() -> str:
    lines = []
    for n, cases in launches().items():
        lines += [f"world {n}: {len(cases)} cases"] + [f"  {c}" for c in cases]
    return "\n".join(lines)


# --- the generator, pure --------------------------------------------------------------


def test_every_pair_of_runnable_settings_is_covered():
    """The covering set covers every pair some runnable combination has,
    holds no refused or unrunnable combination, and fits MAX_WORLD; the
    former refusals stay out until REFUSED loses them."""
    print("\n" + describe())
    chosen = covering_set()
    names = list(AXES)
    everything = [dict(zip(names, v)) for v in itertools.product(*AXES.values())]
    want = set().union(*(pairs_of(c) for c in everything if runnable(c)))
    got = set().union(*(pairs_of(c) for c in chosen))
    assert got == want
    assert all(runnable(c) for c in chosen)
    assert covering_set() == chosen                                    # deterministic
    assert len(chosen) < 40, len(chosen)
    for words in (w for ws in launches().values() for w in ws if "arch=" not in w and "fp8=" not in w):
        assert re.search(r"batch=\d+$", words), words


def test_llama_cases_cover_the_issue_targets():
    """Issue 33's training targets each have a Llama case, in a launch of
    its world size: kv heads replicated on 1-D (tp 4 and 8 over 2 kv
    heads), 2-D, 2.5-D and 3-D, and Llama with pp, cp, zero 1-3, sequence
    parallelism, recompute with accumulation; a checkpoint on two layouts."""
    from mpicube.core.config import ModelConfig

    def split(kw):
        tp, depth = int(kw["tp"]), int(kw.get("depth", 1))
        from mpicube.parallel.layouts import LAYOUTS        # the layouts' own head split

        return LAYOUTS[kw["layout"]].head_coords(tp, depth, 0)[0]

    seen = set()
    for ranks, words in LLAMA_CASES:
        kw = dict(w.split("=", 1) for w in words.split())
        assert ranks == int(kw["tp"]) * int(kw.get("dp", 1)) * int(kw.get("pp", 1)) * int(kw.get("cp", 1)), words
        assert words in LAUNCHES[ranks]
        ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=int(kw["heads"]), n_embd=16, arch="llama",
                    n_kv_head=int(kw["kv"]))
        if split(kw) > int(kw["kv"]):
            seen.add(f"replicated {kw['layout']}" + (f" tp {kw['tp']}" if kw["layout"] == "1d" else ""))
            seen |= {"checkpoint"} if kw.get("ckpt") == "1" else set()
        seen |= {f"{axis} {kw[axis]}" for axis in ("pp", "cp", "zero", "sp") if axis in kw}
        seen |= {"recompute+accum"} if "recompute" in kw and "accum" in kw else set()
    want = {"replicated 1d tp 4", "replicated 1d tp 8", "replicated 2d", "replicated 2.5d", "replicated 3d",
            "pp 2", "cp 2", "zero 1", "zero 2", "zero 3", "sp 1", "recompute+accum", "checkpoint"}
    assert want <= seen, want - seen


# --- the launches ----------------------------------------------------------------------

LAUNCHES = launches()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", list(LAUNCHES), ids=[f"world{n}" for n in LAUNCHES])
def test_combinations_match_serial_and_the_cost_model(ranks):
    """One mpiexec launch per world size runs all of its cases."""
    cases = LAUNCHES[ranks]
    args = []
    for words in cases:
        args += (["--"] if args else []) + words.split()
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/combo_matrix_check.py", *args], timeout=540)
    sys.stdout.write(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK case ") == len(cases), proc.stdout + proc.stderr


def test_four_axes_with_zero3():
    """1-D tp 2 x pp 2 x cp 2 x dp 2 with --zero 3 (16 ranks): in the world-16
    launch above once no pairing it uses is refused."""
    blocked = refused_by(FOUR_AXES)
    if blocked:
        pytest.skip(f"refused in this build: {', '.join(blocked)} (REFUSED in tests/test_combo_matrix.py)")
    assert resolved_words(FOUR_AXES) in LAUNCHES[world(FOUR_AXES)]


def test_refused_pairings_are_still_refused():
    """Each REFUSED entry is a pairing planning.resolve refuses today (one
    line, ConfigError): when a branch lifts one, this fails and names the
    entry to delete, so the matrix starts covering it."""
    from mpicube.core.errors import ConfigError

    smallest = {"pp": {"pp": "1f1b"}, "cp": {"cp": 2}, "sequence_parallel": {"sp": True},
                "zero23": {"zero": 2, "dp": 2}}
    for a, b in sorted(REFUSED):
        combo = {"layout": "1d", "dp": 1, "pp": "none", "cp": 1, "sp": False, "zero": 0, "recompute": "none",
                 "accum": 1, "dtype": "float64", **smallest[a], **smallest[b]}
        with pytest.raises(ConfigError):
            resolved_words(combo)
        print(f"{a} x {b}: refused")


if __name__ == "__main__":      # python tests/test_combo_matrix.py: the launches and their cases
    print(describe())
