"""``--profile START:STOP`` on ``train`` and ``bench``: per-rank timelines
of steps START..STOP (both included, 1-based; bench counts its warm-up
steps too) written as one Chrome trace event file, ``RUN_DIR/profile.json``,
and summarised per rank (DESIGN.md section 11; docs/profiling.md).

What is recorded (``mpicube.parallel.profiler``): on the compute thread the
step, its phases (each micro-batch's forward and backward, the gradient
sync, the gradient norm, the optimizer step) and, nested in them, every
module's forward and backward (name, layer); on one thread per
communication axis every counted call (kind, axis, bytes, peers, blocking
or not), every wait on a nonblocking call, and the flight of each
nonblocking call from its start to the end of its wait (async events).

The file is the trace event format's JSON object form: ``traceEvents``
with "X" complete events, "b"/"e" async pairs and "M" metadata naming each
rank's process ("pid" = world rank) and threads ("tid": 0 compute, then
one per axis, the same number for the same axis on every rank);
timestamps in microseconds on rank 0's clock (the alignment of
``profiler.align_clocks``), ``otherData`` the run's description and each
step's wall time as the trainer or bench measured it. Perfetto and
chrome://tracing open it as it is; ``mpicube timeline`` draws it.

The trace observes the step through ``hooks.StepHooks`` (train) or bench's
own loop; outside the profiled steps nothing is wrapped and
``profiler.ACTIVE`` is None.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import __version__
from ..core.errors import ConfigError
from ..files.atomic import atomic_write
from ..parallel import profiler
from ..parallel.profiler import COMPUTE
from ..training.hooks import StepHooks
from .profile_summary import format_summary, summarize

TRACE_FILE = "profile.json"
SUMMARY_FILE = "profile-summary.json"


class ProfileSession:
    """Profiles steps ``first..last`` of one run on this rank, then writes
    the trace (rank 0) into ``out_dir``. Call ``begin(s)`` at the start of
    every step and ``end(s, timed)`` at its end, on every rank (both
    make world collectives at the first and last profiled step)."""

    def __init__(self, parts, opt, mpi_world, steps: tuple, out_dir, say=print, meta: dict = None):
        self.parts, self.opt, self.world = parts, opt, mpi_world
        self.first, self.last = steps
        self.out_dir, self.say = Path(out_dir), say
        self.meta = dict(meta or {})
        self.recorder = profiler.Recorder(parts.backend.synchronize if parts.backend.is_gpu else None, mpi_world)
        self.clock = None                    # (offset, origin) of align_clocks
        self.walls = {}                      # step -> wall seconds as the caller measured it
        self.wrapped = []
        self.t0 = None
        self.summary = None                  # rank 0, once written: summarize()'s result

    def profiling(self, s: int) -> bool:
        return self.first <= s <= self.last

    def align(self) -> None:
        """Align the clocks (a world collective), if not yet done."""
        if self.clock is None:
            self.clock = profiler.align_clocks(self.world)

    def begin(self, s: int) -> None:
        if not self.profiling(s):
            return
        self.align()
        self._wrap()
        profiler.ACTIVE = self.recorder
        self.parts.backend.synchronize()
        self.t0 = time.perf_counter()

    def end(self, s: int, timed: tuple = None) -> None:
        """Step ``s`` has ended. ``timed``: the (start, end) perf_counter
        readings the caller timed the step with (bench), which then bound
        its span and give its wall time; else the span runs from ``begin``
        to now and the wall time is the span's."""
        if not self.profiling(s) or self.t0 is None:
            return
        self.parts.backend.synchronize()
        t0, t1 = timed if timed is not None else (self.t0, time.perf_counter())
        self.recorder.span(COMPUTE, f"step {s}", t0, t1, {"step": s})
        self.walls[s] = t1 - t0 if timed is not None else None
        self.t0 = None
        profiler.ACTIVE = None
        for w in self.wrapped:
            w.restore()
        self.wrapped = []
        if s == self.last:
            self.write()

    def _wrap(self) -> None:
        rec, model, opt = self.recorder, self.parts.model, self.opt
        for name, layer, module, methods in model.named_modules():
            for method in methods:
                self.wrapped.append(profiler.timed(rec, module, method, f"{name} {method}",
                                                   {"module": name, "layer": layer, "call": method}))
        for obj, method, name in ((model, "forward", "forward"), (model, "backward", "backward"),
                                  (opt, "sync", "gradient sync"), (opt, "grad_norm", "gradient norm"),
                                  (opt, "step", "optimizer step")):
            self.wrapped.append(profiler.timed(rec, obj, method, name, {"phase": name}))

    # --- writing --------------------------------------------------------------
    def _local_events(self) -> dict:
        """This rank's spans and flights in microseconds on rank 0's clock."""
        offset, origin = self.clock

        def us(t):
            return (t - offset - origin) * 1e6

        return {"spans": [(th, n, us(a), us(b), args) for th, n, a, b, args in self.recorder.spans],
                "flights": [(th, n, us(a), us(b), args) for th, n, a, b, args in self.recorder.flights],
                "walls": self.walls}

    def write(self) -> None:
        """Gather every rank's events on rank 0 (an uncounted object gather)
        and write the trace and its summary there."""
        gathered = self.world.gather(self._local_events(), root=0)
        self.recorder = profiler.Recorder(self.recorder.sync, self.world)
        if gathered is None:
            return
        doc = trace_document(gathered, {**self.meta, "steps": [self.first, self.last], "mpicube": __version__})
        path = self.out_dir / TRACE_FILE
        atomic_write(path, [json.dumps(doc).encode()])
        self.summary = summarize(doc)
        atomic_write(self.out_dir / SUMMARY_FILE, [json.dumps(self.summary, indent=1).encode()])
        self.say(f"profile of steps {self.first}-{self.last}: {path} (open it in Perfetto or chrome://tracing; "
                 f"draw it with `mpicube timeline {self.out_dir}`)")
        self.say(format_summary(self.summary))


def trace_document(per_rank: list, meta: dict) -> dict:
    """The trace event JSON object of every rank's events (``_local_events``
    of rank r at index r)."""
    threads = [COMPUTE]
    for rank in per_rank:
        for th, *_ in rank["spans"] + rank["flights"]:
            if th not in threads:
                threads.append(th)
    tid = {th: i for i, th in enumerate(threads)}
    events, flight_id = [], 0
    for pid, rank in enumerate(per_rank):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for th, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": i, "args": {"name": th}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": i, "args": {"sort_index": i}})
        for th, name, t0, t1, args in rank["spans"]:
            cat = "comm" if th != COMPUTE else ("step" if name.startswith("step ") else "compute")
            events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid[th], "ts": t0,
                           "dur": max(t1 - t0, 0.0), "args": args or {}})
        for th, name, t0, t1, args in rank["flights"]:
            flight_id += 1
            common = {"name": name, "cat": "flight", "pid": pid, "tid": tid[th], "id": flight_id}
            events.append({**common, "ph": "b", "ts": t0, "args": args})
            events.append({**common, "ph": "e", "ts": t1})
    walls = {str(pid): {str(s): w for s, w in rank["walls"].items()} for pid, rank in enumerate(per_rank)}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**meta, "world": len(per_rank), "threads": threads, "step_wall_s": walls}}


class ProfileHooks(StepHooks):
    """``train --profile``: a ``ProfileSession`` around the trainer's steps
    (the step span runs from ``step_started``, after the batch is read, to
    ``step_done``, after the metrics line: its wall time)."""

    def __init__(self, steps: tuple, say=print):
        self.steps, self.say, self.session = steps, say, None

    def run_started(self, trainer) -> None:
        first, last = self.steps
        start, stop = trainer.start_step, trainer.opts.last_step
        if last > stop:
            raise ConfigError(f"--profile {first}:{last} is outside the steps this run trains ({start} to {stop})")
        if last < start:
            # Resumed past the range: the same command with --resume (what a
            # stopped run's hint and a requeued job script run) must go on.
            self.say(f"--profile {first}:{last}: those steps were trained before step {start}, where this run "
                     f"resumes; not profiled again")
            return
        steps = (max(first, start), last)
        meta = {"command": "train", **trainer.parts.layout.describe()}
        self.session = ProfileSession(trainer.parts, trainer.opt, trainer.world, steps, trainer.run_dir,
                                      self.say, meta)
        self.session.align()                 # before the steps, so no step's time holds it

    def step_started(self, trainer, s, x, y) -> None:
        if self.session is not None:
            self.session.begin(s)

    def step_done(self, trainer, s, rec) -> None:
        if self.session is not None:
            self.session.end(s)                  # the span is the step (its own step_time_s leaves out the log)
