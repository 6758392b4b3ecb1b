"""The pipeline's cost model without MPI: the bubble it states is the one
the schedule simulation measures, the point-to-point counts are the
schedule's sends, the stages add up to the whole model (plus the tied
wte's second copy and nothing else), and the peak saved activations are the
in-flight micro-batches times one micro-batch's. The runtime's MPI tests
compare these functions with measured counters."""

import dataclasses
import itertools
import json
from fractions import Fraction

import pytest

from mpicube.analysis.costmemory import (activation_terms, chunk_terms, pipeline_peak_activation_bytes,
                                         pipeline_peak_activations, step_memory)
from mpicube.analysis.costmodel import TRAFFIC, Problem, local_param_sizes, step_traffic
from mpicube.analysis.costpipe import (boundary_elems, bubble, measured_bubble, peak_in_flight,
                                       pipeline_received, pipeline_traffic, stage_problem)
from mpicube.core.config import ModelConfig

CFG = ModelConfig(vocab_size=100, n_ctx=16, n_layer=6, n_head=4, n_embd=32)
LAYOUTS = (("serial", 1, 1), ("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1))
TP_AXES = {"tp", "row", "col", "depth", "col_depth", "i", "j", "k", "ij", "ik"}


def problem(layout="3d", tp=8, depth=1, pp=2, schedule="1f1b", v=1, n=4, dtype="float32", recompute="none",
            dp=1, **kw):
    return Problem(CFG, layout, tp, dp, depth, 16 * dp * n, 16, dtype, recompute=recompute, grad_accum=n, pp=pp,
                   pp_schedule=schedule, virtual_stages=v, **kw)


def test_bubble_model_equals_simulation():
    for pp, schedule, v, n in [(2, "gpipe", 1, 3), (3, "1f1b", 1, 5), (4, "1f1b", 1, 2), (2, "interleaved", 3, 4),
                               (3, "interleaved", 2, 6)]:
        p = problem(pp=pp, schedule=schedule, v=v, n=n)
        assert measured_bubble(p) == pytest.approx(bubble(p), abs=1e-12)
    assert bubble(problem(pp=4, n=8)) == pytest.approx(3 / 11)
    assert bubble(problem(pp=2, schedule="interleaved", v=3, n=4)) == pytest.approx(1 / 13)


@pytest.mark.parametrize("layout, tp, depth", LAYOUTS)
def test_point_to_point(layout, tp, depth):
    for pp, schedule, v, n, dtype in [(2, "1f1b", 1, 4, "float32"), (3, "gpipe", 1, 2, "bfloat16"),
                                      (2, "interleaved", 3, 2, "float16")]:
        p = problem(layout, tp, depth, pp, schedule, v, n, dtype)
        shard = boundary_elems(p)
        # the canonical activation (micro-batch of 16 sequences x 16 tokens x 32) over the layout's ranks
        assert shard * (1 if layout in ("serial", "1d") else tp) == 16 * 16 * 32
        sent = recvd = 0
        for s in range(pp):
            t = pipeline_traffic(stage_problem(p, s))
            chunks = [c * pp + s for c in range(v)]
            boundaries = sum((k > 0) + (k < pp * v - 1) for k in chunks)    # a send each way per micro-batch
            assert t.msgs["pp"] == n * boundaries and t.elems["pp"] == n * boundaries * shard
            assert t.bytes["pp"] == t.elems["pp"] * (2 if dtype != "float32" else 4)
            sent += t.elems["pp"]
            recvd += pipeline_received(stage_problem(p, s))["elems"]
        assert sent == recvd == 2 * n * (pp * v - 1) * shard
    assert not pipeline_traffic(problem(pp=1)).msgs


@pytest.mark.parametrize("layout, tp, depth", LAYOUTS)
def test_stages_add_up_to_the_model(layout, tp, depth):
    """Each layer on exactly one stage; the stages' tensor-parallel traffic
    sums to the whole model's plus, where wte is gathered (2-D, 2.5-D,
    3-D), one more gather of the panel and one more reduce-scatter of its
    gradient per micro-batch: the last stage's own."""
    for recompute, (pp, v) in itertools.product(("none", "gathers", "blocks"), ((2, 1), (3, 1), (2, 3))):
        schedule = "interleaved" if v > 1 else "1f1b"
        whole = problem(layout, tp, depth, 1, "1f1b", 1, 2, recompute=recompute)
        p = problem(layout, tp, depth, pp, schedule, v, 2, recompute=recompute)
        stages = [stage_problem(p, s) for s in range(pp)]
        assert sum(s.layers for s in stages) == CFG.n_layer
        names = [set(local_param_sizes(s)) for s in stages]
        assert set.union(*names) == set(local_param_sizes(whole))
        assert sum(len(x) for x in names) == len(local_param_sizes(whole)) + 1          # wte twice
        tp_sum = {"elems": Fraction(0), "msgs": 0}
        for s in stages:
            t = TRAFFIC[layout](s)                          # one micro-batch's forward and backward
            tp_sum["elems"] += t.total_elems()
            tp_sum["msgs"] += t.total_msgs()
            assert step_traffic(s).msgs["tied"] == (2 if (s.has_embed or s.has_head) and pp > 1 else 0)
        t1 = TRAFFIC[layout](whole)
        extra = tp_sum["elems"] - t1.total_elems()
        extra_msgs = tp_sum["msgs"] - t1.total_msgs()
        if layout in ("serial", "1d"):
            assert (extra, extra_msgs) == (0, 0), (layout, recompute, pp, v)
        else:
            # wte's panel: (V_pad, h/q) in 2-D/2.5-D, (V_pad/q, h/q) in 3-D, q = 2 here
            q = 2
            panel = (-(-CFG.vocab_size // q) * q) * (CFG.n_embd // q) // (q if layout == "3d" else 1)
            gather = (q - 1) * panel // q                   # all-gather of the panel's 1/q shards
            reduce = Fraction(q - 1, q) * panel             # reduce-scatter of the panel's gradient
            assert (extra, extra_msgs) == (gather + reduce, 2 * (q - 1)), (layout, recompute, pp, v)


@pytest.mark.parametrize("recompute", ("none", "gathers", "blocks"))
@pytest.mark.parametrize("layout, tp, depth", LAYOUTS)
def test_peak_activations(layout, tp, depth, recompute):
    """V = 1: the peak is min(P - p, N) micro-batches under 1F1B and N under
    GPipe, each holding what one micro-batch keeps on that stage and (on
    the end stages) its own wte panel and gradient, plus one rerun block
    under blocks."""
    for schedule, pp, n, dropout in [("1f1b", 3, 5, False), ("1f1b", 3, 2, True), ("gpipe", 2, 3, True)]:
        p = problem(layout, tp, depth, pp, schedule, 1, n, recompute=recompute)
        for s in range(pp):
            sp = stage_problem(p, s)
            micro, step, rerun = chunk_terms(sp, sp.layers, sp.has_embed, sp.has_head, dropout)
            count = n if schedule == "gpipe" else min(pp - s, n)
            assert peak_in_flight(sp) == count
            want = {k: count * (micro[k] + step[k]) + rerun[k] for k in micro}
            assert pipeline_peak_activations(sp, dropout=dropout) == want, (schedule, s)
            assert step_memory(sp, dropout).activations == sum(want.values())
    # pp 1: the existing model; one micro-batch at a time whatever N
    whole = problem(layout, tp, depth, 1, "1f1b", 1, 4, recompute=recompute)
    assert pipeline_peak_activations(whole) == activation_terms(whole)


def test_interleaved_peak_walks_the_chunks():
    """Stage 0 under interleaved (P 2, V 3, N 4) holds chunk 0 (the lookup)
    and chunks 2, 4; its peak is the largest sum over the points of its
    schedule, which is Megatron's warm-up plus one."""
    p = problem("3d", 8, 1, 2, "interleaved", 3, 4, recompute="none")
    split = p.chunk_layers
    assert [len(r) for r in split] == [1] * 6
    peak = pipeline_peak_activations(p, 0)
    assert peak_in_flight(p, 0) == min(2 * (2 - 1) + 2 * 2 + 1, 12) == 7
    per_chunk = [chunk_terms(p, 1, k == 0, k == 5)[0] for k in (0, 2, 4)]
    step = chunk_terms(p, 0, True, False)[1]                  # chunk 0's wte panel, with each of its micro-batches
    # every chunk's per-micro terms bigger than nothing: the peak at 7 live pairs
    assert sum(peak.values()) >= 7 * min(sum(c.values()) for c in per_chunk)
    assert sum(peak.values()) <= 7 * (max(sum(c.values()) for c in per_chunk) + sum(step.values()))
    b16 = dataclasses.replace(p, dtype="bfloat16")
    assert pipeline_peak_activation_bytes(b16, 0) < pipeline_peak_activation_bytes(p, 0)


PAPER = ModelConfig(vocab_size=50304, n_ctx=2048, n_layer=24, n_head=64, n_embd=8192)


def test_a_pipeline_beats_every_flat_grid_at_512_ranks():
    """The paper's model on 512 ranks (batch 512, bfloat16, nodes of 8):
    3-D tp 8 x pp 8 x dp 8 under 1F1B holds less per rank and sends fewer
    bytes across nodes than the dp x tp grid without a pipeline that sends
    the fewest (3-D tp 8 x dp 64), each with its own best --grad-accum."""
    from mpicube.analysis.costpipereport import combinations, pipeline_problem, worst

    rows = combinations(PAPER, 512, 512, "bfloat16")
    flat = min((w for p, w in rows if p.pp == 1), key=lambda w: (w["cross_node"], w["memory"]))
    best_flat = next(p for p, w in rows if w is flat)
    assert (best_flat.layout, best_flat.tp, best_flat.dp) == ("3d", 8, 64)
    pipe = worst(pipeline_problem("3d", PAPER, 512, 512, 8, 1, 8, "1f1b", 1, "bfloat16", grad_accum=16))
    assert pipe["memory"] < flat["memory"] / 1.8 and pipe["cross_node"] < flat["cross_node"] / 5
    assert pipe["bubble"] == pytest.approx(7 / 23)
    assert pipe["bytes"]["pp"] > 0 and pipe["bytes"]["tp"] > pipe["bytes"]["dp"] > 0


def test_info_pp(mpicube):
    r = mpicube.run("info", "-n", 8, "--layout", "1d", "--n-layer", 4, "--pp", 2, "--grad-accum", 4,
                    "--pp-schedule", "interleaved", "--virtual-stages", 2, "--batch-size", 8, "--json")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "world 8 = dp 1 x pp 2 x tp 4" in out and "bubble 11.1% of the step" in out
    assert "0-1" not in out and "0,2+embed" in out and "1,3+head" in out        # chunks k = v P + p, one layer each
    assert "dp x pp x tp at world 8" in out and "<- best without pp" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["pp"] == 2 and summary["virtual_stages"] == 2 and [s["in_flight"] for s in summary["stages"]] == [5, 3]
    bad = mpicube.run("info", "-n", 8, "--n-layer", 4, "--pp", 2, "--virtual-stages", 2)
    assert bad.returncode == 2 and bad.stdout.count("--virtual-stages 2 applies to --pp-schedule interleaved only") + \
        bad.stderr.count("--virtual-stages 2 applies to --pp-schedule interleaved only") == 1


def test_info_validates_the_axes_as_train_does(mpicube):
    """info resolves the same plan train does, once: --pp with --cp, which
    composes now, names every axis of the world (it used to print "tp 1,
    cp 2" and then a world without cp, or blame the world size 1 of one
    stage), and a world they do not divide is refused as train refuses it."""
    r = mpicube.run("info", "--pp", 2, "--cp", 2, "-n", 8, "--layout", "1d")
    assert r.returncode == 0, r
    assert "world 8 = dp 1 x pp 2 x cp 2 x tp 2" in r.stdout and "cp bytes" in r.stdout, r
    refusal = "error: --pp 2 x --cp 2 = 4 must divide the world size {}; their product must be one of {}"
    r = mpicube.run("info", "--pp", 2, "--cp", 2, "-n", 6, "--layout", "1d")
    assert r.returncode == 2 and r.error_lines() == [refusal.format(6, [1, 2, 3, 6])], r
    r = mpicube.run("train", "--pp", 2, "--cp", 2, "--layout", "1d", "--steps", 1)
    assert r.returncode == 2 and r.error_lines() == [refusal.format(1, [1])], r


def _script_defaults(name: str) -> dict:
    """The ``: "${VAR:=value}"`` defaults of a job script."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "jobs" / name).read_text()
    return dict(re.findall(r'\$\{(\w+):=([^}]*)\}', text))


@pytest.mark.parametrize("script, world", [("slurm_512gpu.sh", 512), ("slurm_64gpu.sh", 64)])
def test_job_scripts_pipelines_pay(script, world):
    """The bigger Slurm scripts' default pipelines are valid for their model
    and send fewer bytes across nodes of 4 GPUs (their #SBATCH layout) than
    the single cube of the same world, with a bubble under 35 %."""
    from mpicube.analysis.costpipereport import pipeline_problem, worst

    v = _script_defaults(script)
    cfg = ModelConfig(vocab_size=256, n_ctx=int(v["SEQ_LEN"]), n_layer=int(v["N_LAYER"]), n_head=int(v["N_HEAD"]),
                      n_embd=int(v["N_EMBD"]))
    p = pipeline_problem(v["LAYOUT"], cfg, int(v["BATCH_SIZE"]), world, int(v.get("DP", 1)), 1, int(v["PP"]),
                         v["PP_SCHEDULE"], int(v["VIRTUAL_STAGES"]), v["DTYPE"], grad_accum=int(v["GRAD_ACCUM"]))
    assert not isinstance(p, str), p
    pipe = worst(p, ranks_per_node=4)
    # the cube with 4 micro-batches, the scripts' comparison
    flat = worst(pipeline_problem(v["LAYOUT"], cfg, int(v["BATCH_SIZE"]), world, 1, 1, 1, "1f1b", 1, v["DTYPE"],
                                  grad_accum=4), ranks_per_node=4)
    assert pipe["cross_node"] < flat["cross_node"] / 2 and pipe["bubble"] < 0.35


# ------------------------------------------------- the cost model's bubble of a run (analysis/costbubble.py)

@pytest.mark.parametrize("layout,tp,depth", LAYOUTS)
def test_phase_flops_add_up_to_the_step(layout, tp, depth):
    """Each chunk's F, B and W (``chunk_phase_flops``), over a stage's
    chunks and the micro-batches, are ``step_flops`` of the stage: the
    modelled bubble prices the same work the FLOP count does, split as a
    zero-bubble schedule splits it (W: the linears' dW only)."""
    from mpicube.analysis.costbubble import stage_work
    from mpicube.analysis.costflops import chunk_phase_flops, step_flops

    for schedule, v, recompute in (("1f1b", 1, "none"), ("zbv", 2, "blocks"), ("interleaved", 3, "none")):
        p = problem(layout, tp, depth, pp=2, schedule=schedule, v=v, recompute=recompute)
        for s, work in enumerate(stage_work(p)):
            assert sum(work.values()) == step_flops(stage_problem(p, s)), (layout, schedule, s)
        if schedule == "1f1b":                                 # 3 layers each: the head is the difference
            first, last = chunk_phase_flops(p, 0), chunk_phase_flops(p, 1)
            assert last["forward"] > first["forward"] and last["backward_input"] > first["backward_input"]
            assert last["backward_weight"] == first["backward_weight"]


def test_modelled_bubble_weighs_the_stages_the_actions_and_the_transfers():
    """The model's bubble of a run: with actions, elementwise passes and
    transfers free it is the simulator's idle share at the FLOPs' phase
    times, above the formula for 1F1B (the head's stage is longer) and for
    ZB-H1 (W, the dW GEMMs, is shorter than F = B = W says); the
    elementwise passes shorten W against F and B, and raise ZB-H1's
    bubble; a slower link and a costlier action only add to it; and at
    the stated rates every zero-bubble schedule stays below 1F1B's."""
    from mpicube.analysis.costbubble import DEFAULT_RATES, Rates, modelled_bubble, phase_seconds

    cfg = ModelConfig(vocab_size=256, n_ctx=128, n_layer=8, n_head=8, n_embd=256)
    runs = {s: Problem(cfg, "serial", 1, 1, 1, 16, 128, grad_accum=8, pp=2, pp_schedule=s,
                       virtual_stages=2 if s in ("zbv", "dualpipev") else 1)
            for s in ("1f1b", "zb-h1", "zbv", "dualpipev")}
    flops_only = Rates(memory_rate=float("inf"), action_time=0.0, bandwidth=float("inf"), latency=0.0)
    free = {s: modelled_bubble(p, flops_only) for s, p in runs.items()}
    assert free["1f1b"] > bubble(runs["1f1b"]) and free["zb-h1"] > bubble(runs["zb-h1"])
    gemms, both = phase_seconds(runs["zb-h1"], flops_only), phase_seconds(runs["zb-h1"])
    assert gemms[0, "backward_weight"] < gemms[0, "forward"] < gemms[0, "backward_input"]
    assert both[0, "backward_weight"] / both[0, "forward"] < gemms[0, "backward_weight"] / gemms[0, "forward"]
    passes = dataclasses.replace(flops_only, memory_rate=DEFAULT_RATES.memory_rate)
    assert modelled_bubble(runs["zb-h1"], passes) > free["zb-h1"]
    for s, p in runs.items():
        slow_link = dataclasses.replace(DEFAULT_RATES, bandwidth=1e6)
        slow_action = dataclasses.replace(DEFAULT_RATES, action_time=2 * DEFAULT_RATES.action_time)
        assert modelled_bubble(p, passes) < modelled_bubble(p) < modelled_bubble(p, slow_link), s
        assert modelled_bubble(p) < modelled_bubble(p, slow_action), s
        assert s == "1f1b" or modelled_bubble(p) < modelled_bubble(runs["1f1b"]), s


def test_elementwise_passes_follow_the_shapes():
    """``costpasses``: one GPT-2 block's F, B and W elements are the
    docstring's table at its shapes (written out here per pass); W holds
    the bias sums (none for Llama, which has no biases) and the
    gradients' accumulation, 3 per weight element on all micro-batches
    but the step's first (the weights: W's FLOPs over 2 tokens); the last
    chunk adds ln_f and the cross-entropy over the vocabulary, chunk 0 the
    lookup; dropout adds to F and B only; and 1-D without
    --sequence-parallel keeps the canonical region whole on each tp rank."""
    from mpicube.analysis.costflops import chunk_phase_flops
    from mpicube.analysis.costpasses import chunk_phase_elements

    cfg = ModelConfig(vocab_size=64, n_ctx=16, n_layer=3, n_head=4, n_embd=32)
    p = Problem(cfg, "serial", 1, 1, 1, 8, 16, grad_accum=2, pp=3)     # a block a stage
    N, C, S = 4 * 16, 32, 4 * 4 * (16 * 16)                            # tokens, width, scores (one 16-block)
    middle = chunk_phase_elements(p, 1)
    biases = 3 * C + C + 4 * C + C
    assert middle["forward"] == N * (2 * 5 * C + 2 * 3 * C + 2 * C + 2 * C + 7 * 4 * C + 2 * biases) + 5 * S
    assert middle["backward_input"] == N * (2 * 8 * C + 2 * 3 * C + 2 * C + 2 * C + 4 * 4 * C) + 7 * S
    accumulate = 3 * 12 * C * C * Fraction(1, 2)                      # 2 micro-batches: the second adds
    assert middle["backward_weight"] == N * biases + accumulate
    assert 12 * C * C == chunk_phase_flops(p, 1)["backward_weight"] / (2 * N)
    first, last = chunk_phase_elements(p, 0), chunk_phase_elements(p, 2)
    assert first["forward"] - middle["forward"] == N * 5 * C and first["backward_weight"] == N * biases + accumulate
    assert last["forward"] - middle["forward"] == N * (5 * C + 10 * 64)
    assert last["backward_input"] - middle["backward_input"] == N * (8 * C + 2 * 64)
    dropped = chunk_phase_elements(p, 1, dropout=0.1)
    assert dropped["forward"] == middle["forward"] + N * 2 * 6 * C + 6 * S
    assert dropped["backward_input"] == middle["backward_input"] + N * 2 * 3 * C + 11 * S
    assert dropped["backward_weight"] == middle["backward_weight"]
    rerun = chunk_phase_elements(dataclasses.replace(p, recompute="blocks"), 1)
    assert rerun["backward_input"] == middle["backward_input"] + middle["forward"]
    llama = ModelConfig(vocab_size=64, n_ctx=16, n_layer=3, n_head=4, n_embd=32, arch="llama")
    lp = dataclasses.replace(p, cfg=llama)
    assert chunk_phase_elements(lp, 1)["backward_weight"] == 3 * chunk_phase_flops(lp, 1)["backward_weight"] / (
        2 * N) / 2
    tp1d, seqpar = (Problem(cfg, "1d", 4, 1, 1, 8, 16, grad_accum=2, pp=3, sequence_parallel=sp) for sp in (0, 1))
    canonical = N * (2 * 5 * C + 2 * 3 * C)                           # a block's norms and residual adds
    assert chunk_phase_elements(tp1d, 1)["forward"] - chunk_phase_elements(seqpar, 1)["forward"] == (
        canonical - Fraction(canonical, 4))


def test_pipeline_page_holds_the_modelled_bubbles():
    """docs/pipeline.md's measured-bubble table: its formula and model
    columns are what ``info`` computes for those runs now
    (tools/bubble_table.py --check; the measured columns are a run's)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bubble_table", root / "tools" / "bubble_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)                                  # in process: no second interpreter to start
    assert tool.check(root / "docs" / "pipeline.md") == 0
