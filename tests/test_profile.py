"""`--profile` on bench and train, and `mpicube timeline`, on real runs.

An 8-rank 3-D bench writes a trace that the trace event format accepts
(required keys and types, spans nested on every thread, async flights
matched, every rank present) and whose compute + exposed communication +
idle spans account for each profiled step's wall time, as bench measured
it on its own clock, within 5% on every rank; its communication spans
carry exactly the bytes the counters (and so the cost model) count. The
picture is drawn from it. A 2-rank train writes one too; a range outside
the run is one line and exit status 2. In-process, on one rank: profiling
leaves nothing wrapped behind, and the validator catches what it is for.
"""

import copy
import json

import pytest
from conftest import TINY, last_json

from mpicube.analysis.profile_summary import summarize, validate

MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def comm_bytes_of_step(doc, pid, step):
    """Bytes on rank ``pid``'s communication calls (not waits) in profiled ``step``."""
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == pid]
    span = next(e for e in events if e.get("cat") == "step" and e["args"]["step"] == step)
    return sum(e["args"]["bytes"] for e in events if e.get("cat") == "comm" and not e["name"].startswith("wait ")
               and span["ts"] <= e["ts"] <= span["ts"] + span["dur"])


def test_bench_profile_on_8_ranks_accounts_for_every_step(mpicube):
    mpicube.env["MPIEXEC_TIMEOUT"] = "120"          # 8 ranks on a small machine start slowly
    r = mpicube.run("bench", "--layout", "3d", *MODEL, "--warmup-steps", "1", "--steps", "3", "--profile", "2:3",
                    "--out", "prof", "--json", n=8, timeout=150)
    assert r.returncode == 0, r
    assert "profile of steps 2-3: prof/profile.json" in r.stdout, r
    result = last_json(r.stdout)["results"][0]
    doc = json.loads((mpicube.cwd / "prof" / "profile.json").read_text())
    assert validate(doc) == []
    assert doc["otherData"]["world"] == 8 and doc["otherData"]["layout"] == "3d"
    threads = doc["otherData"]["threads"]
    assert threads[0] == "compute" and {"comm i", "comm j", "comm k"} <= set(threads)

    summary = summarize(doc)
    assert sorted(summary["ranks"]) == list(range(8))
    for pid, rank in summary["ranks"].items():
        assert sorted(rank["steps"]) == [2, 3], pid
        for s, f in rank["steps"].items():
            # the 5% target: the spans tile the step that bench timed on its own clock
            assert f["accounting_error"] <= 0.05, (pid, s, f)
            assert min(f["compute_s"], f["exposed_s"], f["idle_s"]) >= 0.0, (pid, s, f)
            assert f["communication_s"] >= f["exposed_s"] * (1 - 1e-9), (pid, s, f)
    saved = json.loads((mpicube.cwd / "prof" / "profile-summary.json").read_text())
    assert saved["ranks"]["0"]["steps"]["2"] == summary["ranks"][0]["steps"][2]

    # rank 0's bytes on the wire per step, from the spans, are the counters' (== the cost model's)
    assert result["comm"]["exact"]
    for s in (2, 3):
        assert comm_bytes_of_step(doc, 0, s) == result["comm"]["measured_bytes"]

    names = {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == 5}
    assert {"forward", "backward", "gradient sync", "gradient norm", "optimizer step", "h.0 forward",
            "h.0.attn.c_attn backward", "h.0.mlp.c_proj forward", "wte logits", "ln_f backward"} <= names
    assert any(e["ph"] == "b" and e["name"].startswith("iallgather") for e in doc["traceEvents"])
    assert any(e.get("ph") == "X" and e["name"].startswith("wait iallgather") for e in doc["traceEvents"])
    spans = [e for e in doc["traceEvents"] if e.get("cat") == "comm"]
    assert all(set(e["args"]) >= {"kind", "axis", "bytes", "peers", "blocking"} for e in spans)
    assert all(len(e["args"]["peers"]) == 2 for e in spans if e["args"]["axis"] in ("i", "j", "k"))
    prof = result["profile"]
    assert prof["steps"] == [2, 3] and prof["max_accounting_error"] <= 0.05
    assert 0.0 <= result["exposed_comm_fraction"] <= 1.0

    pytest.importorskip("matplotlib")
    r = mpicube.run("timeline", "prof", "--out", "pictures/timeline.png")
    assert r.returncode == 0, r
    assert "wrote pictures/timeline.png: 8 rank(s), " in r.stdout, r
    out = mpicube.cwd / "pictures" / "timeline.png"
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000

    from mpicube.analysis.timeline import draw
    from mpicube.core.errors import UserError

    with pytest.raises(UserError, match="no such trace"):
        draw(mpicube.cwd / "nowhere", mpicube.cwd / "x.png")
    (mpicube.cwd / "bad.json").write_text("{")
    with pytest.raises(UserError, match="not a JSON trace"):
        draw(mpicube.cwd / "bad.json", mpicube.cwd / "x.png")


def test_train_profile_and_a_range_outside_the_run(mpicube):
    """2 ranks as two ZB-H1 stages: the trace holds each deferred weight
    phase ("backward weight", between forwards and backwards), and the
    timeline measures the pipeline's bubble from it."""
    r = mpicube.run("train", *TINY[2:], "--layout", "1d", "--steps", "4", "--profile", "2:3", "--out", "run",
                    "--n-layer", "2", "--pp", "2", "--pp-schedule", "zb-h1", "--grad-accum", "2", n=2)
    assert r.returncode == 0, r
    doc = json.loads((mpicube.cwd / "run" / "profile.json").read_text())
    assert validate(doc) == []
    from mpicube.analysis.timeline import draw, pipeline_bubble

    weights = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"] == "backward weight"]
    assert len(weights) == 2 * 2 * 2                 # 2 steps x 2 stages x 2 micro-batches
    assert doc["otherData"]["pp_schedule"] == "zb-h1" and 0 < pipeline_bubble(doc) < 1
    assert "pipeline bubble" in draw(mpicube.cwd / "run", mpicube.cwd / "run" / "t.png")
    summary = summarize(doc)
    assert sorted(summary["ranks"]) == [0, 1]
    assert all(sorted(rank["steps"]) == [2, 3] for rank in summary["ranks"].values())
    assert (mpicube.cwd / "run" / "profile-summary.json").exists()
    assert "exposed" in r.stdout and "accounted" in r.stdout

    r = mpicube.run("train", *TINY, "--steps", "2", "--profile", "2:9", "--out", "run2")
    assert r.returncode == 2, r
    assert r.error_lines() == ["error: --profile 2:9 ends after the last step this run trains, 2 "
                               "(--steps, --stop-after)"], r
    r = mpicube.run("bench", *TINY, "--profile", "4:2")
    assert r.returncode == 2 and "START:STOP" in r.error_lines()[0], r


def test_bench_overlap_both_times_each_setting(mpicube):
    """--overlap-both: each layout with its collectives blocking, then
    overlapped, in one run: the same bytes (the cost model's) and each
    setting's exposed fraction, so what overlap hides can be read off."""
    model = ["--n-layer", "1", "--n-head", "4", "--n-embd", "16", "--seq-len", "16"]
    r = mpicube.run("bench", "--layout", "1d", "--layout", "2d", *model, "--warmup-steps", "0", "--steps", "1",
                    "--overlap-both", "--json", n=4)
    assert r.returncode == 0, r
    results = last_json(r.stdout)["results"]
    assert [(x["layout"], x["overlap"]) for x in results] == [("1d", False), ("1d", True), ("2d", False),
                                                               ("2d", True)]
    for off, on in (results[:2], results[2:]):
        assert off["comm"]["measured_bytes"] == on["comm"]["measured_bytes"] == on["comm"]["predicted_bytes"]
        assert 0 < off["exposed_comm_fraction"] <= 1 and 0 < on["exposed_comm_fraction"] <= 1
    assert "1d/off" in r.stdout and "2d/off" in r.stdout
    r = mpicube.run("bench", *MODEL, "--overlap-both", "--profile", "1:2")
    assert r.returncode == 2 and r.error_lines() == ["error: --profile records one setting: drop --overlap-both, "
                                                     "or profile each setting in its own run"], r


def test_profile_in_process_leaves_nothing_behind(tmp_path):
    """Serial on one rank: a profiled step among plain ones; afterwards no
    module or optimizer method is wrapped and no recorder is active."""
    from mpi4py import MPI

    from mpicube.analysis.bench import bench_layout
    from mpicube.analysis.profile import ProfileSession, profiled_modules
    from mpicube.core.config import ModelConfig
    from mpicube.parallel import profiler
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import build_parts

    cfg = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=2, n_embd=16)
    recorder = profiler.Recorder()
    parts = build_parts(resolve("serial", cfg, 4, MPI.COMM_WORLD.Get_size(), seq_len=16), MPI.COMM_WORLD,
                        recorder=recorder)
    assert parts.layout.axes.world.recorder is recorder and parts.layout.axes.dp.recorder is recorder
    sessions = []

    def session(opt):
        sessions.append(ProfileSession(parts, opt, MPI.COMM_WORLD, (3, 3), tmp_path, say=lambda line: None))
        return sessions[0]

    result = bench_layout(parts, 16, 1, 3, profile=session)
    assert not recorder.on and not hasattr(profiler, "ACTIVE")       # off again; no process-wide switch
    modules = profiled_modules(parts.model)
    assert {name for name, *_ in modules} == {"wte", "h.0", "h.0.ln_1", "h.0.attn.c_attn", "h.0.attn.c_proj",
                                              "h.0.ln_2", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "ln_f"}
    assert not any(m in vars(mod) for _, _, mod, methods in modules for m in methods)
    assert "forward" not in vars(parts.model) and "step" not in vars(sessions[0].opt)
    assert set(result["profile"]) >= {"profiled_step_s", "plain_step_s", "overhead", "overhead_cpu",
                                       "trace_fractions"}
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert validate(doc) == [] and list(summarize(doc)["ranks"]) == [0]
    assert result["profile"]["max_accounting_error"] <= 0.05


def test_validate_finds_what_breaks_the_format():
    good = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "rank 1"}},
        {"ph": "X", "name": "step 1", "cat": "step", "pid": 0, "tid": 0, "ts": 0.0, "dur": 100.0, "args": {"step": 1}},
        {"ph": "X", "name": "forward", "cat": "compute", "pid": 0, "tid": 0, "ts": 10.0, "dur": 50.0},
        {"ph": "X", "name": "allreduce", "cat": "comm", "pid": 0, "tid": 1, "ts": 70.0, "dur": 20.0},
        {"ph": "X", "name": "step 1", "cat": "step", "pid": 1, "tid": 0, "ts": 0.0, "dur": 100.0, "args": {"step": 1}},
        {"ph": "B", "name": "b", "pid": 1, "tid": 0, "ts": 1.0},
        {"ph": "E", "name": "b", "pid": 1, "tid": 0, "ts": 2.0},
        {"ph": "b", "name": "iallgather", "cat": "flight", "id": 1, "pid": 1, "tid": 2, "ts": 5.0},
        {"ph": "e", "name": "iallgather", "cat": "flight", "id": 1, "pid": 1, "tid": 2, "ts": 9.0},
    ], "otherData": {"world": 2}}
    assert validate(good) == []
    f = summarize(good)["ranks"][0]["steps"][1]
    assert (f["compute_s"], f["exposed_s"], f["idle_s"]) == pytest.approx((50e-6, 20e-6, 30e-6))
    assert f["accounting_error"] == pytest.approx(0.0)

    def broken(change):
        doc = copy.deepcopy(good)
        change(doc["traceEvents"])
        return validate(doc)

    assert broken(lambda ev: ev[3].update(dur=95.0))               # runs past the end of its step
    assert broken(lambda ev: ev[3].pop("dur"))
    assert broken(lambda ev: ev[4].update(ts="70"))
    assert broken(lambda ev: ev[1].update(name="thread_name"))    # rank 1's process is unnamed
    def rank_1_silent(ev):
        ev[:] = [e for e in ev if e["pid"] != 1 or e["ph"] == "M"]

    assert broken(rank_1_silent)                                   # rank 1 named, but no events
    assert broken(lambda ev: ev.pop(7))                            # B without E
    assert broken(lambda ev: ev.pop(9))                            # async begin without end
    assert broken(lambda ev: ev[2].update(ph="Z"))
    assert validate({"events": []}) == ["not a JSON object with a traceEvents list"]
    # two top-level spans that overlap count twice: accounted exceeds the step
    doc = copy.deepcopy(good)
    doc["traceEvents"].append({"ph": "X", "name": "backward", "cat": "compute", "pid": 0, "tid": 0, "ts": 40.0,
                               "dur": 30.0})
    assert validate(doc)
    assert summarize(doc)["ranks"][0]["steps"][1]["accounting_error"] > 0.05


def test_pipeline_bubble_takes_each_rank_s_own_step_span():
    """The ranks enter a step at different times: stage 0's first forward
    starts before stage 1's span of the step does, and still counts (it
    once fell outside the one span taken for all ranks, which dropped it
    from the window and from stage 0's work). Worked by hand: window 1..35,
    stage 0 busy 4 + 10, stage 1 busy 8 + 10, idle (34 - 14) + (34 - 18)."""
    from mpicube.analysis.timeline import pipeline_bubble

    def span(pid, name, ts, end, cat="compute"):
        return {"ph": "X", "pid": pid, "tid": 0, "cat": cat, "name": name, "ts": ts, "dur": end - ts,
                "args": {"step": 1} if cat == "step" else {}}

    events = [span(0, "step 1", 0, 40, "step"), span(0, "forward", 1, 5), span(0, "backward", 25, 35),
              span(1, "step 1", 3, 40, "step"), span(1, "forward", 6, 14), span(1, "backward", 14, 24)]
    assert pipeline_bubble({"traceEvents": events}) == pytest.approx(36 / 68)
