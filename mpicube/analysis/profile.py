"""``--profile START:STOP`` on ``train`` and ``bench``: per-rank timelines
of steps START..STOP (both included, 1-based; bench counts its warm-up
steps too) written as one Chrome trace event file, ``RUN_DIR/profile.json``,
and summarised per rank (docs/design.md section 11; docs/profiling.md).

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
own loop. The communicators record into the ``profiler.Recorder`` they were
built with (``build_parts(..., recorder=)``: ``ProfileHooks.recorder`` for
train, bench's own); a session switches that recorder on for the profiled
steps only, and outside them nothing is wrapped and the recorder is off.
Which modules are timed is read off the model from outside
(``profiled_modules``): the model itself knows nothing of profiling.
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


# (attribute, GPT-2 name) of a block's layers, in the order a forward calls them
# A block's layers a profile times, by their path inside the block (GPT-2's
# names); a path the block lacks (a mixture's MLP has no c_fc) is skipped.
BLOCK_LAYERS = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
EMBEDDING_CALLS = ("embed", "logits", "logits_backward", "embed_backward")   # the tied wte's, lookup and head
LAYER_CALLS = ("forward", "backward")


def chunk_models(model) -> list:
    """The ``model.gpt.GPT`` objects a step of ``model`` runs: a
    ``training.driver.Runner``'s one, or each local chunk of a
    ``training.pipeline.Pipeline`` (made now if no step has made it yet)."""
    if hasattr(model, "chunk_model"):                            # a pipeline stage: one GPT per local chunk
        return [model.chunk_model(v) for v in range(len(model.chunks))]
    return [getattr(model, "model", model)]


def _module_at(block, path: str):
    """The module at the dotted ``path`` inside ``block``, or None."""
    for attr in path.split("."):
        block = getattr(block, attr, None)
    return block


def profiled_modules(model) -> list:
    """(GPT-2 name, layer or None, module, methods) of every module whose
    calls a profile times, walked from outside: for each chunk of ``model``
    (``chunk_models``) the tied embedding of its ``front`` (the lookup) or
    its ``back`` (the LM head), each of its ``blocks`` (under a wrapper
    such as ``Recomputed``, the wrapper, and the layers of the block it
    wraps) and the final LayerNorm of its ``back``. Each module once."""
    out, seen = [], set()

    def add(name, layer, module, methods):
        if module is not None and id(module) not in seen:
            seen.add(id(module))
            out.append((name, layer, module, methods))

    for gpt in chunk_models(model):
        for piece in gpt.front:
            add("wte", None, piece.embedding, EMBEDDING_CALLS)
        for piece in gpt.back:                                   # a last chunk without the lookup: the head's wte
            add("wte", None, piece.loss.embedding, EMBEDDING_CALLS)
        for i, block in zip(gpt.layers, gpt.blocks):
            inner = getattr(block, "block", block)                  # under a wrapper, the block itself
            add(inner.site, i, block, LAYER_CALLS)
            for path in BLOCK_LAYERS:
                add(f"{inner.site}.{path}", i, _module_at(inner, path), LAYER_CALLS)
        for piece in gpt.back:
            add("ln_f", None, piece.ln_f, LAYER_CALLS)
    return out


def phase_calls(model, opt) -> list:
    """(object, method, phase name) of a step's phases: the model's forward
    and backward (a pipeline's: each chunk's; under a zero-bubble schedule
    its input part B), a pipeline's deferred weight phases W ("backward
    weight": ``parallel.wgrad``, run by the schedule's W actions), the
    gradient sync, the gradient norm and the optimizer step."""
    runs = chunk_models(model) if hasattr(model, "chunk_model") else [model]
    calls = [(m, method, method) for method in ("forward", "backward") for m in runs]
    if hasattr(model, "chunk_model"):
        calls.append((model.store.wgrads, "run", "backward weight"))
    return calls + [(opt, "sync", "gradient sync"), (opt, "grad_norm", "gradient norm"),
                    (opt, "step", "optimizer step")]


class ProfileSession:
    """Profiles steps ``first..last`` of one run on this rank, then writes
    the trace (rank 0) into ``out_dir``. Call ``begin(s)`` at the start of
    every step and ``end(s, timed)`` at its end, on every rank (both
    make world collectives at the first and last profiled step). ``parts``
    must have been built with a ``profiler.Recorder``
    (``build_parts(..., recorder=)``): the session records into it."""

    def __init__(self, parts, opt, mpi_world, steps: tuple, out_dir, say=print, meta: dict = None):
        self.parts, self.opt, self.world = parts, opt, mpi_world
        self.first, self.last = steps
        self.out_dir, self.say = Path(out_dir), say
        self.meta = dict(meta or {})
        self.recorder = parts.layout.axes.world.recorder
        if self.recorder is None:
            raise ValueError("a profile needs communicators built with a recorder: "
                             "build_parts(..., recorder=profiler.Recorder())")
        self.recorder.sync = parts.backend.synchronize if parts.backend.is_gpu else None
        self.recorder.world = mpi_world
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
        self.recorder.start()
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
        self.recorder.stop()
        for w in reversed(self.wrapped):
            w.restore()
        self.wrapped = []
        if s == self.last:
            self.write()

    def _wrap(self) -> None:
        rec, model = self.recorder, self.parts.model
        for name, layer, module, methods in profiled_modules(model):
            for method in methods:
                self.wrapped.append(profiler.timed(rec, module, method, f"{name} {method}",
                                                   {"module": name, "layer": layer, "call": method}))
        for obj, method, name in phase_calls(model, self.opt):
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
        self.recorder.clear()
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
    ``step_done``, after the metrics line: its wall time). ``recorder``
    is to be handed to the communicators the trainer builds
    (``Trainer(recorder=)``); it stays off outside the profiled steps."""

    def __init__(self, steps: tuple, say=print):
        self.steps, self.say, self.session = steps, say, None
        self.recorder = profiler.Recorder()

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
        pipe = getattr(trainer.parts, "pipeline", None)
        if pipe is not None:                 # the timeline measures the bubble of these
            meta.update(pp=pipe.P, pp_schedule=pipe.schedule, virtual_stages=pipe.V, micro_batches=pipe.N)
        self.session = ProfileSession(trainer.parts, trainer.opt, trainer.world, steps, trainer.run_dir,
                                      self.say, meta)
        self.session.align()                 # before the steps, so no step's time holds it

    def step_started(self, trainer, s, x, y) -> None:
        if self.session is not None:
            self.session.begin(s)

    def step_done(self, trainer, s, rec) -> None:
        if self.session is not None:
            self.session.end(s)                  # the span is the step (its own step_time_s leaves out the log)
