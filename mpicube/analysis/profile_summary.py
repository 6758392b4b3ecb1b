"""What a profile's trace says, per rank and step, and whether it is a
well-formed trace event file (``mpicube.analysis.profile`` writes it).

Per step, from the spans alone (docs/profiling.md):

- *compute*: the step's top-level compute spans (its phases: forward,
  backward, gradient sync, gradient norm, optimizer step), less the
  communication calls and waits inside them;
- *exposed communication*: time in blocking calls, in nonblocking starts
  and in waits, i.e. communication that nothing overlapped (the rank
  could do nothing else);
- *idle*: the gaps of the step covered by neither (the trainer's own
  bookkeeping between phases);
- *communication*: time during which any communication of the rank was
  under way (exposed, or in flight between a nonblocking start and its
  wait); *overlapped* = communication - exposed.

Compute, exposed and idle are summed span by span (not as the remainder of
the step), so ``accounted = compute + exposed + idle`` equals the step's
wall time only if the spans tile the step without overlapping: a span
counted twice, or a top-level span running past its neighbour, shows as
``accounted`` above the wall time; time the spans miss cannot hide, since
idle is only what lies between spans. ``accounting_error`` is
``|accounted - wall| / wall`` against the wall time the caller measured
(bench: the same two clock readings its step time comes from), else the
step span's own.
"""

from __future__ import annotations

from collections import defaultdict

EPS_US = 0.01              # rounding slack of microsecond timestamps, for nesting
KNOWN_PHASES = {"X", "B", "E", "b", "e", "M", "i", "I", "C"}


def _x_events(doc):
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def _inside(e, t0, t1) -> bool:
    return e["ts"] >= t0 - EPS_US and e["ts"] + e["dur"] <= t1 + EPS_US


def _top_level(spans: list) -> list:
    """The spans not contained in another of ``spans`` (sorted by start)."""
    top = []
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        if top and e["ts"] + e["dur"] <= top[-1]["ts"] + top[-1]["dur"] + EPS_US:
            continue
        top.append(e)
    return top


def _union(intervals: list) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def step_figures(step, compute: list, comm: list, flights: list, wall_s=None) -> dict:
    """Seconds of one step of one rank (module docstring); ``step`` is its
    X event, the others its rank's events of each kind."""
    s0, s1 = step["ts"], step["ts"] + step["dur"]
    top = _top_level([e for e in compute if _inside(e, s0, s1)])
    calls = [e for e in comm if _inside(e, s0, s1)]
    inner = {id(c) for c in calls if any(_inside(c, t["ts"], t["ts"] + t["dur"]) for t in top)}
    compute_us = sum(t["dur"] for t in top) - sum(c["dur"] for c in calls if id(c) in inner)
    exposed_us = sum(c["dur"] for c in calls)
    tiles = sorted([(t["ts"], t["ts"] + t["dur"]) for t in top]
                   + [(c["ts"], c["ts"] + c["dur"]) for c in calls if id(c) not in inner])
    idle_us, edge = 0.0, s0
    for a, b in tiles + [(s1, s1)]:
        idle_us += max(a - edge, 0.0)
        edge = max(edge, b)
    flying = [(max(a, s0), min(b, s1)) for a, b in flights if b > s0 and a < s1]
    communication_us = _union([(c["ts"], c["ts"] + c["dur"]) for c in calls] + flying)
    wall = step["dur"] / 1e6 if wall_s is None else float(wall_s)
    out = {"wall_s": wall, "span_s": step["dur"] / 1e6, "compute_s": compute_us / 1e6,
           "exposed_s": exposed_us / 1e6, "idle_s": idle_us / 1e6, "communication_s": communication_us / 1e6,
           "overlapped_s": max(communication_us - exposed_us, 0.0) / 1e6}
    out["accounted_s"] = out["compute_s"] + out["exposed_s"] + out["idle_s"]
    out["accounting_error"] = abs(out["accounted_s"] - wall) / wall if wall > 0 else 0.0
    return out


def summarize(doc: dict) -> dict:
    """{"ranks": {rank: {"steps": {step: step_figures}, "total": sums and
    fractions of the wall time}}} of a trace document."""
    walls = doc.get("otherData", {}).get("step_wall_s", {})
    by_rank = defaultdict(lambda: {"step": [], "compute": [], "comm": [], "flights": {}})
    for e in doc["traceEvents"]:
        ph, r = e.get("ph"), by_rank[e.get("pid")]
        if ph == "X":
            r["step" if e.get("cat") == "step" else ("comm" if e.get("cat") == "comm" else "compute")].append(e)
        elif ph in ("b", "e"):
            r["flights"].setdefault(e["id"], {})[ph] = e["ts"]
    ranks = {}
    for pid in sorted(k for k in by_rank if k is not None):
        r = by_rank[pid]
        flights = [(f["b"], f["e"]) for f in r["flights"].values() if "b" in f and "e" in f]
        steps = {}
        for step in sorted(r["step"], key=lambda e: e["ts"]):
            s = step.get("args", {}).get("step")
            steps[s] = step_figures(step, r["compute"], r["comm"], flights, walls.get(str(pid), {}).get(str(s)))
        total = {k: sum(f[k] for f in steps.values()) for k in
                 ("wall_s", "compute_s", "exposed_s", "idle_s", "communication_s", "overlapped_s", "accounted_s")}
        wall = total["wall_s"] or 1.0
        for k in ("compute", "exposed", "idle", "communication", "overlapped", "accounted"):
            total[k + "_fraction"] = total[k + "_s"] / wall
        total["max_accounting_error"] = max((f["accounting_error"] for f in steps.values()), default=0.0)
        ranks[pid] = {"steps": steps, "total": total}
    return {"ranks": ranks, "steps": doc.get("otherData", {}).get("steps")}


def format_summary(summary: dict) -> str:
    head = (f"{'rank':>4} {'steps':>5} {'ms/step':>9} {'compute':>8} {'exposed':>8} {'idle':>6} "
            f"{'comm':>6} {'overlap':>8} {'accounted':>10}")
    lines = [head, "-" * len(head)]
    for pid, r in summary["ranks"].items():
        t, n = r["total"], max(len(r["steps"]), 1)
        lines.append(f"{pid:>4} {len(r['steps']):>5} {t['wall_s'] / n * 1e3:>9.2f} "
                     + " ".join(f"{100 * t[k + '_fraction']:>{w - 1}.1f}%" for k, w in
                                (("compute", 8), ("exposed", 8), ("idle", 6), ("communication", 6),
                                 ("overlapped", 8), ("accounted", 10))))
    lines.append("Fractions of the steps' wall time: compute (less communication inside it), exposed "
                 "communication (blocking calls, starts, waits), idle (between spans); comm = any communication "
                 "under way, overlap = comm - exposed; accounted = compute + exposed + idle")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the format


def validate(doc) -> list:
    """Problems of ``doc`` as a trace event file of a profile (empty: none):
    the JSON object form with required keys and types, "X" events with a
    duration, B/E pairs and X events properly nested on each thread, async
    b/e pairs matched, and every rank of ``otherData.world`` present."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    problems, threads, open_async, named = [], defaultdict(list), {}, set()
    for n, e in enumerate(doc["traceEvents"]):
        where = f"event {n}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in KNOWN_PHASES:
            problems.append(f"{where}: phase {ph!r} is not a trace event phase")
            continue
        for key, types in (("name", str), ("pid", int), ("tid", int)):
            if not isinstance(e.get(key), types) or isinstance(e.get(key), bool):
                problems.append(f"{where}: {key!r} missing or not {types.__name__}")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args is not an object")
        if ph == "M":
            if e.get("name") == "process_name":
                named.add(e.get("pid"))
            continue
        if not isinstance(e.get("ts"), (int, float)) or isinstance(e.get("ts"), bool):
            problems.append(f"{where}: 'ts' missing or not a number")
            continue
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"{where}: an X event needs a duration 'dur' >= 0")
                continue
            threads[e.get("pid"), e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e.get("name")))
        elif ph in ("B", "E"):
            threads[e.get("pid"), e.get("tid")].append((e["ts"], ph, e.get("name")))
        elif ph in ("b", "e"):
            key = (e.get("pid"), e.get("cat"), e.get("id"))
            if e.get("id") is None or not isinstance(e.get("cat"), str):
                problems.append(f"{where}: an async event needs 'cat' and 'id'")
            elif ph == "b":
                open_async[key] = e["ts"]
            elif key not in open_async or e["ts"] < open_async.pop(key):
                problems.append(f"{where}: async end without an earlier begin")
    problems += [f"async event {k} never ends" for k in open_async]
    for (pid, tid), items in threads.items():
        problems += _nesting(pid, tid, items)
    world = doc.get("otherData", {}).get("world")
    if isinstance(world, int):
        seen = {pid for pid, _ in threads}
        for rank in range(world):
            if rank not in seen or rank not in named:
                problems.append(f"rank {rank} has no named process with events")
    return problems


def _nesting(pid, tid, items) -> list:
    """Problems of one thread's spans: X intervals and B/E pairs must nest."""
    spans = [(a, b, name) for a, b, name in items if not isinstance(b, str)]
    stack, problems = [], []
    for a, b, name in sorted(spans, key=lambda s: (s[0], -(s[1] - s[0]))):
        while stack and stack[-1][1] <= a + EPS_US:
            stack.pop()
        if stack and b > stack[-1][1] + EPS_US:
            problems.append(f"pid {pid} tid {tid}: {name!r} overlaps {stack[-1][2]!r} without nesting")
        stack.append((a, b, name))
    begun = []
    for ts, ph, name in sorted(((a, b, n) for a, b, n in items if isinstance(b, str)), key=lambda s: s[0]):
        if ph == "B":
            begun.append(name)
        elif not begun:
            problems.append(f"pid {pid} tid {tid}: E of {name!r} without a B")
        else:
            begun.pop()
    problems += [f"pid {pid} tid {tid}: B of {n!r} never ends" for n in begun]
    return problems
