"""The pipeline schedules without MPI: every schedule the CLI can build for
P 1..4 stages, N 1..8 micro-batches and V 1..3 virtual chunks satisfies the
contract's invariants, completes under the executor's blocking semantics,
and has the model's bubble; a planted wrong order is caught."""

import itertools

import pytest

from mpicube.core.errors import ConfigError
from mpicube.parallel.schedules import (SCHEDULES, Action, Deadlock, bubble_fraction, build_schedule,
                                        check_pipeline, check_pp_world, in_flight, layer_split,
                                        message_tag, peak_in_flight, simulate)


def valid_cases():
    """(name, P, N, V) for every combination build_schedule accepts."""
    for name, P, N, V in itertools.product(SCHEDULES, range(1, 5), range(1, 9), range(1, 4)):
        if V > 1 and name != "interleaved":
            continue
        if name == "interleaved" and (P < 2 or N % P):
            continue
        yield name, P, N, V


CASES = list(valid_cases())


def test_case_count():
    # gpipe and 1f1b: 4 x 8 each; interleaved: P=2 (4 N values), 3 (2), 4 (2) times 3 V values
    assert len(CASES) == 32 + 32 + (4 + 2 + 2) * 3


@pytest.mark.parametrize("name", SCHEDULES)
def test_invariants(name):
    for case in [c for c in CASES if c[0] == name]:
        _, P, N, V = case
        sched = build_schedule(name, P, N, V)
        assert len(sched) == P
        last = P * V - 1
        sends = {}
        for p, acts in enumerate(sched):
            assert all(a.op in ("forward", "backward") or 0 <= a.peer < P for a in acts), case
            for m, v in itertools.product(range(N), range(V)):
                ops = [(i, a.op) for i, a in enumerate(acts) if (a.micro, a.chunk) == (m, v)
                       and a.op in ("forward", "backward")]
                assert [o for _, o in ops] == ["forward", "backward"], (case, p, m, v)
            for i, a in enumerate(acts):
                k = a.chunk * P + p
                if a.op.startswith("recv"):            # right before the compute that consumes it
                    nxt = acts[i + 1]
                    assert (nxt.op, nxt.micro, nxt.chunk) == (
                        "forward" if a.op == "recv_act" else "backward", a.micro, a.chunk), case
                    assert a.peer == ((k - 1) % P if a.op == "recv_act" else (k + 1) % P)
                if a.op.startswith("send"):            # right after the compute that produced it
                    prev = acts[i - 1]
                    assert (prev.op, prev.micro, prev.chunk) == (
                        "forward" if a.op == "send_act" else "backward", a.micro, a.chunk), case
                    tag = message_tag(a, p, P, V, N)
                    assert tag not in sends, case
                    sends[tag] = (p, a)
                if a.op == "forward":                 # chunk 0 has no producer, the last no consumer
                    assert (i > 0 and acts[i - 1].op == "recv_act") == (k > 0), case
                if a.op == "backward":
                    assert (i > 0 and acts[i - 1].op == "recv_grad") == (k < last), case
        recvs = {message_tag(a, p, P, V, N): (p, a) for p, acts in enumerate(sched)
                 for a in acts if a.op.startswith("recv")}
        assert len(recvs) == sum(a.op.startswith("recv") for acts in sched for a in acts)
        assert sends.keys() == recvs.keys(), case       # every send has its receive, and back
        for tag, (p, a) in sends.items():
            q, b = recvs[tag]
            assert (a.peer, b.peer, a.op[5:], a.micro) == (q, p, b.op[5:], b.micro), case
        assert len(sends) == 2 * N * last


def test_in_flight_bounds():
    for name, P, N, V in CASES:
        sched = build_schedule(name, P, N, V)
        peaks = [peak_in_flight(acts) for acts in sched]
        if name == "gpipe":
            assert peaks == [N] * P
        elif name == "1f1b" or V == 1:
            assert peaks == [min(P - p, N) for p in range(P)], (name, P, N, V)
            assert peaks[0] <= P
        else:
            # Megatron's warm-up plus the one steady-state forward
            assert peaks == [min(2 * (P - 1 - p) + (V - 1) * P + 1, N * V) for p in range(P)]
        for acts in sched:
            assert in_flight(acts)[-1] == ()            # every activation freed by the step's end


def test_simulation_completes_with_the_model_bubble():
    """Unit-time chunks, and backwards 2x and 3x as long as forwards: the
    measured idle share equals bubble_fraction exactly in every case."""
    for name, P, N, V in CASES:
        sched = build_schedule(name, P, N, V)
        for fb in ((1, 1), (1, 2), (1, 3)):
            result = simulate(sched, *fb)
            assert result["bubble"] == pytest.approx(bubble_fraction(name, P, N, V), abs=1e-12), (name, P, N, V, fb)
            assert result["busy"] == [N * V * sum(fb)] * P


def test_simulation_with_unequal_stages_and_transfers():
    """The cost model's bubble of a run (``analysis.costbubble``) feeds the
    simulator per-stage times and transfer delays. 1F1B, P 2, N 2, the last
    stage three times as slow (F 3, B 6 against 1 and 2), each message d
    late: stage 1 ends its B1 at 19 + d, stage 0 gets that gradient at
    19 + 2d and ends at 21 + 2d, busy 6 and 18 of 2 (21 + 2d) - worked by
    hand. Uniform ``times`` give the plain run's figures exactly."""
    sched = build_schedule("1f1b", 2, 2)
    slow = {"forward": (1.0, 3.0), "backward": (2.0, 6.0)}
    for d, bubble in ((0.0, 18 / 42), (0.5, 20 / 44)):
        r = simulate(sched, times=lambda p, a: slow[a.op][p], transfer=lambda p, a: d)
        assert r["time"] == pytest.approx(21 + 2 * d) and r["busy"] == [6.0, 18.0]
        assert r["bubble"] == pytest.approx(bubble, abs=1e-12)
        assert [(s, a.op, a.micro) for s, _, a in r["timeline"][0]][2] == (10 + 2 * d, "backward", 0)
    zb = build_schedule("zb-h1", 4, 8)
    even = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    assert simulate(zb, times=lambda p, a: even[a.op], name="zb-h1")["bubble"] == pytest.approx(
        simulate(zb, 1, 2, "zb-h1")["bubble"], abs=1e-12)
    late = simulate(zb, times=lambda p, a: even[a.op], transfer=lambda p, a: 0.25, name="zb-h1")
    assert late["bubble"] > bubble_fraction("zb-h1", 4, 8)        # transfers only ever add idle time
    # the executor's time before each action (idle): 1F1B, P 2, N 1, F 1, B 2, each action a = 0.5
    # first: stage 0 starts F0 at a, sends at 1 + 2a; stage 1 receives at 1 + 2a, runs F0 from 1 + 3a,
    # B0 from 2 + 4a to 4 + 4a, sends at 4 + 5a; stage 0 runs B0 from 4 + 6a to 6 + 6a. The step as a
    # profile measures it, first phase to last, is 6 + 5a; busy 3 of it on each stage
    one = build_schedule("1f1b", 2, 1)
    r = simulate(one, 1, 2, overhead=lambda p, a: 0.5)
    assert r["time"] == pytest.approx(8.5) and r["busy"] == [3.0, 3.0]
    assert r["bubble"] == pytest.approx(11 / 17, abs=1e-12)
    assert [(s, a.op) for s, _, a in r["timeline"][0]] == [(0.5, "forward"), (7.0, "backward")]


def test_interleaving_shrinks_the_bubble():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8) == bubble_fraction("1f1b", 4, 8)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("interleaved", 4, 8, 1) == bubble_fraction("1f1b", 4, 8)


def test_planted_wrong_orders_are_caught():
    good = build_schedule("1f1b", 2, 2)
    simulate(good)
    # Both stages receive first: stage 0 waits for a gradient before sending the activation.
    bad = [list(acts) for acts in good]
    recv = next(a for a in bad[0] if a.op == "recv_grad")
    bad[0].remove(recv)
    bad[0].insert(0, recv)
    with pytest.raises(Deadlock, match="stage 0 waits at.*recv_grad.*stage 1 waits at.*recv_act"):
        simulate(bad)
    # Stage 1 takes the micro-batches in the other order than stage 0 sends gradients for.
    swapped = [list(acts) for acts in build_schedule("gpipe", 3, 2)]
    last = swapped[2]
    i, j = last.index(Action("recv_act", 0, 0, 1)), last.index(Action("recv_act", 1, 0, 1))
    last[i], last[j] = last[j], last[i]
    simulate(swapped)                                    # tags keep a reordered receive matched
    # A receive from the wrong stage never matches.
    wrong = [list(acts) for acts in build_schedule("1f1b", 3, 1)]
    wrong[1][0] = Action("recv_act", 0, 0, 2)
    with pytest.raises(Deadlock, match="stage 1 waits"):
        simulate(wrong)
    # A missing receive leaves a message nobody takes.
    missing = [list(acts) for acts in build_schedule("1f1b", 2, 1)]
    missing[1] = [a for a in missing[1] if a.op != "recv_act"]
    with pytest.raises(Deadlock, match="never received"):
        simulate(missing)


def test_layer_split():
    assert [list(r) for r in layer_split(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert layer_split(8, 8) == [range(i, i + 1) for i in range(8)]
    for n, c in itertools.product(range(1, 13), range(1, 13)):
        if c > n:
            with pytest.raises(ConfigError):
                layer_split(n, c)
            continue
        parts = layer_split(n, c)
        assert [i for r in parts for i in r] == list(range(n))
        sizes = [len(r) for r in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("args, words", [
    ((12, 13), "--pp 13 exceeds n_layer 12 .* use --pp 12 or less"),
    ((12, 2, "1f1b", 2), "--virtual-stages 2 applies to --pp-schedule interleaved only"),
    ((12, 4, "interleaved", 2, 8), "8 chunks must divide n_layer 12: use --virtual-stages 1 or 3, or --n-layer 8 or 16"),
    ((12, 2, "interleaved", 2, 5), "--grad-accum 5 must be a multiple of 2: use --grad-accum 4 or 6"),
    ((12, 4, "interleaved", 3, 6), "--grad-accum 6 must be a multiple of 4: use --grad-accum 4 or 8"),
    ((12, 1, "interleaved", 2, 2), "needs --pp 2 or more"),
    ((12, 2, "zigzag"), "unknown --pp-schedule 'zigzag'"),
    ((12, 0), "--pp must be at least 1"),
])
def test_check_pipeline_refuses(args, words):
    with pytest.raises(ConfigError, match=words) as err:
        check_pipeline(*args)
    assert "\n" not in str(err.value)


def test_check_pipeline_accepts_and_notes():
    assert check_pipeline(12, 4, "1f1b", 1, 8) is None
    assert check_pipeline(12, 2, "interleaved", 3, 4) is None
    assert check_pipeline(12, 1, "gpipe", 1, 1) is None
    note = check_pipeline(12, 4, "1f1b", 1, 2)
    assert "bubble is 60%" in note and "--grad-accum 4 or more" in note
    assert check_pp_world(16, 2, 2) == 4
    with pytest.raises(ConfigError, match="--pp 3 must divide the world size 16 / --dp 2: use --pp 2 or 4"):
        check_pp_world(16, 3, 2)


# --------------------------------------------------------------------------- zero bubble

def test_zero_bubble_h1_splits_every_backward_and_beats_1f1b():
    """ZB-H1 (schedules_zb.py) for P 2..5, N 1..9: every micro-batch runs
    forward, B, W in that order on every stage, W in B's order (so each
    weight gradient's sum order is the unsplit one); a receive sits right
    before its compute and a send right after; tapes in flight are 1F1B's
    min(P - p, N) and filed weight phases at most min(p + 1, N); the simulated
    bubble (F = B = W) equals zb_bubble_fraction exactly and is below
    1F1B's from N >= 2."""
    from mpicube.parallel.schedules import in_weight_phase

    for P, N in itertools.product(range(2, 6), range(1, 10)):
        sched = build_schedule("zb-h1", P, N)
        for p, acts in enumerate(sched):
            compute = [a for a in acts if a.op in ("forward", "backward_input", "backward_weight")]
            for m in range(N):
                assert [a.op for a in compute if a.micro == m] == ["forward", "backward_input", "backward_weight"]
            bs = [a.micro for a in compute if a.op == "backward_input"]
            assert bs == sorted(bs) and [a.micro for a in compute if a.op == "backward_weight"] == bs, (P, N, p)
            for i, a in enumerate(acts):
                if a.op == "recv_grad":
                    assert (acts[i + 1].op, acts[i + 1].micro) == ("backward_input", a.micro)
                if a.op == "send_grad":
                    assert (acts[i - 1].op, acts[i - 1].micro) == ("backward_input", a.micro)
            assert peak_in_flight(acts) == min(P - p, N), (P, N, p)
            assert max(len(x) for x in in_weight_phase(acts)) <= min(p + 1, N), (P, N, p)
            assert in_weight_phase(acts)[-1] == () and in_flight(acts)[-1] == ()
        zb = simulate(sched, 1, 2)
        assert zb["bubble"] == pytest.approx(bubble_fraction("zb-h1", P, N), abs=1e-12), (P, N)
        assert zb["busy"] == [3 * N] * P
        one = simulate(build_schedule("1f1b", P, N), 1, 2)["bubble"]
        assert one == pytest.approx(bubble_fraction("1f1b", P, N), abs=1e-12)
        if N >= 2:
            assert zb["bubble"] < one, (P, N)
    assert bubble_fraction("zb-h1", 4, 8) == pytest.approx(3 / 27)       # (P-1)/(3N+P-1) against 1F1B's 3/11


def test_zero_bubble_bad_input_names_the_option():
    """A schedule that does not fit --pp or --virtual-stages: one line naming the option and what works."""
    from mpicube.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--pp-schedule zb-h1 needs --pp 2 or more"):
        check_pipeline(4, 1, "zb-h1")
    with pytest.raises(ConfigError, match=r"--virtual-stages 2 applies to --pp-schedule interleaved only"):
        check_pipeline(4, 2, "zb-h1", virtual=2)
    with pytest.raises(ConfigError, match=r"unknown --pp-schedule 'zb'; choose one of .*zb-h1"):
        check_pipeline(4, 2, "zb")


def test_vee_schedules_turn_on_the_last_stage_and_beat_zb_h1():
    """ZBV (P 2..5, N 1..9) and DualPipeV (N >= 2P): stage p holds model
    chunks p and 2P-1-p; the turn (chunks P-1, P) and nothing else stays
    on a stage without a message; each (micro, chunk) runs forward then a
    whole backward or B then W; a chunk's backwards (whole or B) and Ws
    run in micro-batch order; every message has its receive; the
    simulated bubble equals bubble_fraction exactly, is below ZB-H1's for
    N >= P, and the tapes stay within 2 min(P, N) chunk-tapes (ZBV) or
    2P + 1 (DualPipeV, the DualPipe paper's PP + 1)."""
    from mpicube.parallel.schedules import in_weight_phase, model_chunk

    cases = [("zbv", P, N) for P in range(2, 6) for N in range(1, 10)]
    cases += [("dualpipev", P, N) for P in range(2, 6) for N in range(2 * P, 2 * P + 4)]
    for name, P, N in cases:
        sched = build_schedule(name, P, N, 2)
        assert [model_chunk(name, p, v, P) for p in range(P) for v in (0, 1)] == \
            [k for p in range(P) for k in (p, 2 * P - 1 - p)]
        sends = sum(a.op.startswith("send") for acts in sched for a in acts)
        assert sends == 2 * N * (2 * P - 2), (name, P, N)          # every boundary but the turn, both ways
        for p, acts in enumerate(sched):
            for v in (0, 1):
                ops = [a for a in acts if a.chunk == v and a.op in
                       ("forward", "backward", "backward_input", "backward_weight")]
                for m in range(N):
                    mine = [a.op for a in ops if a.micro == m]
                    assert mine in (["forward", "backward"], ["forward", "backward_input", "backward_weight"])
                backs = [a.micro for a in ops if a.op in ("backward", "backward_input")]
                weights = [a.micro for a in ops if a.op in ("backward", "backward_weight")]
                assert backs == sorted(backs) and weights == sorted(weights), (name, P, N, p, v)
            cap = 2 * min(P, N) if name == "zbv" else 2 * P + 1
            assert peak_in_flight(acts) <= cap and in_flight(acts)[-1] == () and in_weight_phase(acts)[-1] == ()
        result = simulate(sched, 0.5, 1.0, name)                   # a chunk: half a stage's F, B + W = 2F
        assert result["bubble"] == pytest.approx(bubble_fraction(name, P, N, 2), abs=1e-12), (name, P, N)
        if N >= P:
            assert result["bubble"] < bubble_fraction("zb-h1", P, N) < bubble_fraction("1f1b", P, N)
    assert bubble_fraction("zbv", 4, 8, 2) == pytest.approx(3 / 51)            # (P-1)/(6N+P-1)


def test_vee_bad_input_names_the_option():
    from mpicube.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--pp-schedule zbv runs two chunks a stage \(a V\): use --virtual-stages 2"):
        check_pipeline(8, 2, "zbv", virtual=1, grad_accum=4)
    with pytest.raises(ConfigError, match=r"--pp 4 x 2 chunks of --pp-schedule zbv exceeds n_layer 6: use --pp 3"):
        check_pipeline(6, 4, "zbv", virtual=2, grad_accum=4)
    with pytest.raises(ConfigError, match=r"dualpipev needs at least 2 x --pp 2 micro-batches: --grad-accum 3: "
                                          r"use --grad-accum 4 or more"):
        check_pipeline(4, 2, "dualpipev", virtual=2, grad_accum=3)
    assert check_pipeline(4, 2, "dualpipev", virtual=2, grad_accum=4) is None


def test_pipeline_page_holds_the_bubble_table_the_schedules_give():
    """docs/pipeline.md's bubble table (formula, simulated, tapes, weight
    phases of every schedule at P 4, N 8) is what tools/pipeline_pictures.py
    computes from the schedules now (its --check: no drawing)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "tools/pipeline_pictures.py", "--check", "docs/pipeline.md"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mtp_is_refused_where_a_v_folds_the_model_end_onto_stage_0():
    """MTP's depths sit on the last stage; zbv and dualpipev put the last chunk on stage 0."""
    from mpicube.core.config import ModelConfig
    from mpicube.core.errors import ConfigError
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve

    cfg = ModelConfig(arch="deepseek_v3", n_layer=4, n_head=2, n_embd=16, kv_lora_rank=8, qk_rope_head_dim=4,
                      qk_nope_head_dim=8, v_head_dim=8, mtp_depth=1)
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=rf"--mtp-depth .* --pp-schedule {schedule} folds .* zb-h1 or 1f1b"):
            resolve(Plan(pp=2, pp_schedule=schedule, virtual_stages=2, grad_accum=4), cfg, 8, 2)
    assert resolve(Plan(pp=2, pp_schedule="zb-h1", grad_accum=4), cfg, 8, 2).plan.pp == 2
