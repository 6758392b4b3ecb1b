"""Pipeline parallelism (``--pp P``): this rank's stage of the model and the
executor that runs a schedule's action list on it.

Stage p holds model chunks p, P + p, ..., (V-1)P + p (``--virtual-stages
V``), each a contiguous run of layers (``schedules.layer_split``); chunk 0
also holds the embeddings, chunk PV-1 the final LayerNorm and the LM head.
A chunk is a ``GPT`` built with ``layers``/``first``/``last``: the model is
written once. Every stage runs the same tensor-parallel layout, so a stage
boundary needs no re-layout: each tensor-parallel rank sends its own
canonical activation block (B_c, T, C_c) to the rank with the same (d, c, t)
in the next stage, over ``axes.pp``, in the working format.

Why the executor is data driven: ``schedules.build_schedule`` returns each
stage's ordered actions (forward/backward of micro-batch m on chunk v,
sends, receives). The executor posts every receive of the step up front,
nonblocking and in list order, waits for each at its ``recv_*`` action
(right before the compute that consumes it), and starts each send
nonblocking at its ``send_*`` action, completing all sends at the end of
the step. Message tags encode (kind, micro, sending chunk), so order between
two peers cannot mismatch; a list whose order cannot complete hangs in a
receive, which the watchdog (``--collective-timeout``) names and ends.

Each chunk is one ``GPT``; each (chunk, micro-batch) in flight has its own
tape (``self.tapes``): under 1F1B up to P micro-batches of a chunk are
between their forward and their backward on one stage at once. A
zero-bubble schedule's ``backward_input`` runs the same ``GPT.backward``
inside ``store.wgrads.collect()``, so the linears file their dW work
(``self.filed``) and its ``backward_weight`` runs it (``parallel.wgrad``);
the model does not know which. In a V (zbv, dualpipev) chunks P-1 and P
share the last stage: the activation and its gradient are handed over in
the stage's outbox, with no message.

The numerics are those of the same step without a pipeline: micro-batch m
is ``Parts.micro_rows(m)`` of the step's batch, dropout masks are drawn at
global sequence indices (``Dropout.first_seq``), every micro-batch's loss is
divided by the step's token count, and backward adds into the gradient
buffers. The tied ``wte``: stage 0 (lookup) and stage P-1 (head) each hold a
copy in the layout's sharding; the step's gradient synchronisation
(``parallel.gradients.GradientSync``) sums their gradients over the pair
(axis "tied"), so both copies take the same optimizer step. The gradient
norm counts the tensor once: both copies declare twice the layout's replica count (so each counts half), and only
stage 0's copy is written to a checkpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model.block import Recomputed
from ..model.gpt import GPT, gpt_params  # noqa: F401 (GPT: tests plant faults on it)
from ..model.tape import saved_buffers
from .driver import MtpLog, RouterLog, build_gpt, canonical_length, last_logits, micro_context
from ..parallel.comm_p2p import irecv, isend
from ..parallel.experts import model_specs
from ..parallel.schedules import (DEFAULT_SCHEDULE, VEE_SCHEDULES, Action, build_schedule, chunk_place,
                                  layer_split, message_tag, model_chunk)


def stage_chunks(n_layer: int, stages: int, stage: int, virtual: int = 1, schedule: str = DEFAULT_SCHEDULE) -> list:
    """(local chunk v, model chunk k, layers) of every chunk stage ``stage``
    holds, in the schedule's placement (``schedules.model_chunk``: a V under zbv)."""
    split = layer_split(n_layer, stages * virtual)
    return [(v, model_chunk(schedule, stage, v, stages), split[model_chunk(schedule, stage, v, stages)])
            for v in range(virtual)]


def stage_names(cfg, stages: int, stage: int, virtual: int = 1, schedule: str = DEFAULT_SCHEDULE) -> set:
    """The parameter names stage ``stage`` holds."""
    last = stages * virtual - 1
    names = set()
    for _, k, layers in stage_chunks(cfg.n_layer, stages, stage, virtual, schedule):
        names.update(f"h.{i}." for i in layers)
        if k == 0:
            names.update(("wte", "wpe"))
        if k == last:
            names.update(("wte" if cfg.tied else "lm_head", "ln_f."))   # an untied head (Llama): its own
            if cfg.mtp_depth:               # multi-token prediction: its blocks, tensors and a wte for its lookup
                names.update(["wte", "mtp."] + [f"h.{i}." for i in range(cfg.n_layer, cfg.n_blocks)])
    return names


def stage_specs(layout, cfg, virtual: int = 1, schedule: str = DEFAULT_SCHEDULE) -> list:
    """This rank's ParamSpecs: its stage's parameters only. With more than
    one stage the tied ``wte`` is held twice (stage 0 and stage P-1), so each
    copy declares twice the layout's replicas (the norm counts it once) and
    only stage 0's copy writes it to a checkpoint."""
    pp = layout.axes.pp
    keep = stage_names(cfg, pp.size, pp.rank, virtual, schedule)
    decls = [d for d in gpt_params(cfg) if any(d.name == k or (k.endswith(".") and d.name.startswith(k)) for k in keep)]
    specs = []
    for spec in model_specs(layout, decls):     # a mixture's experts: this ep rank's only
        name = spec.name
        if name == "wte" and pp.size > 1 and (cfg.tied or cfg.mtp_depth) and schedule not in VEE_SCHEDULES:
            # held by stages 0 and P-1 (the head's or the MTP depths' lookup); a V keeps both ends on stage 0
            spec = dataclasses.replace(spec, replicas=2 * spec.replicas, writer=spec.writer and pp.rank == 0,
                                       tied_pair=True)
        specs.append(spec)
    return specs


def same_tokens(layout) -> int:
    """How many ranks of the tensor-parallel group hold each token: all
    of them, unless the layout splits the sequences over some of them
    (2-D, 2.5-D, 3-D: ``Layout.token_comm``)."""
    tokens = layout.token_comm
    return layout.axes.tp.size // (1 if tokens is None else tokens.size)


class Pipeline:
    """This rank's chunks and the executor of their schedule (module
    docstring). ``forward_backward`` and ``forward_loss`` answer what
    ``training.accum``'s functions of the same names do without stages."""

    def __init__(self, cfg, layout, store, *, schedule: str = "1f1b", virtual: int = 1, dropout: float = 0.0,
                 seed: int = 0, grad_accum: int = 1, actions=None):
        self.cfg, self.layout, self.store = cfg, layout, store
        self.pp = layout.axes.pp
        self.P, self.V, self.N = self.pp.size, virtual, grad_accum
        self.stage = self.pp.rank
        self.schedule = schedule
        self.dropout, self.seed = dropout, seed
        self.chunks = stage_chunks(cfg.n_layer, self.P, self.stage, virtual, schedule)     # (v, k, layers)
        self.last_chunk = self.P * virtual - 1
        # local chunk -> the local chunk that feeds it (a V's turn: chunks P-1 and P on the last stage), or None
        self.local_prev = {v: chunk_place(schedule, k - 1, self.P)[1] for v, k, _ in self.chunks
                           if k > 0 and chunk_place(schedule, k - 1, self.P)[0] == self.stage}
        self.local_next = {w: v for v, w in self.local_prev.items()}
        # the action list: the schedule's, or one a test plants
        self.actions = actions if actions is not None else build_schedule(schedule, self.P, grad_accum,
                                                                           virtual)[self.stage]
        self.models = {}                        # v -> the GPT of local chunk v (one for every micro-batch)
        self.tapes = {}                         # (v, micro) -> the tape of a forward whose backward has not run
        self.filed = {}                         # (v, micro) -> the weight work its B filed, until its W runs
        # (elements, bytes) the most held for backward at once, when measured: after
        # every forward, and under --recompute blocks during a backward's rerun
        self.peak_saved = (0, 0)
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        self._rerun = (0, 0)                    # the most one rerun block held in the backward running now
        self.current = None                     # (chunk, tape) of the last forward
        self.ledgers = {}                       # (train, micro) -> a mixture's RouterLedger this step
        self.router_log = RouterLog(layout.backend.to_host)
        self.mtp_log = MtpLog()                 # multi-token prediction's losses, per step
        for v in range(len(self.chunks)):       # built now: their persistent buffers (a router's bias) are in
            self.chunk_model(v)                 # the store before a checkpoint is read into it

    # --- chunks -------------------------------------------------------------
    def chunk_model(self, v: int, micro: int = 0, dropout: float = None) -> GPT:
        """The GPT of local chunk ``v`` (made once; every micro-batch runs it
        with its own tape, training or evaluation alike)."""
        if v not in self.models:
            _, k, layers = self.chunks[v]
            model = build_gpt(self.cfg, self.layout, self.store, dropout=self.dropout, seed=self.seed,
                              grad_accum=self.N, layers=layers, first=k == 0, last=k == self.last_chunk)
            for block in model.blocks:
                if isinstance(block, Recomputed):
                    block.probe = self._rebuilt
            self.models[v] = model
        return self.models[v]

    def _rebuilt(self, saved) -> None:
        buffers = saved_buffers(saved, self.store.buffers())
        self._rerun = (max(self._rerun[0], sum(b.size for b in buffers)),
                       max(self._rerun[1], sum(b.nbytes for b in buffers)))

    def _run_forward(self, model, v, m, parts, x, y, step, inbox, train=True):
        """Chunk ``v``'s forward of micro-batch m: (out, Micro). ``inbox``
        holds the previous chunk's output when this chunk has no embeddings."""
        rows = parts.micro_rows(m)
        ids, tgt, ctx = micro_context(self.layout, x[rows], y[rows], step, m, self.N, train)
        if ctx.router is not None:              # a mixture: one ledger per micro-batch for all chunks here
            ctx = dataclasses.replace(ctx, router=self.ledgers.setdefault((train, m), ctx.router))
        out, tape = model.forward(ids if model.first else inbox, tgt, ctx)
        self.current = (model, tape)            # for an observer (a trace) after the forward
        return out, tape, ctx

    def _share(self, out, ctx) -> np.ndarray:
        """A last chunk's loss shares on this rank (1 + D,): the main
        cross-entropy's divided by the step's tokens, each MTP depth's by
        its own global count (model/mtp.py)."""
        sums = self.layout.backend.to_host(out).astype(np.float64)                 # (1 + D,)
        return np.array([sums[0] / ctx.n_tokens] + [s / n for s, n in zip(sums[1:], ctx.mtp_counts)])

    def _tag(self, a) -> int:
        return message_tag(a, self.stage, self.P, self.V, self.N, self.schedule)

    def _block_shape(self, T: int) -> tuple:
        """(B_c, T_c, C_c): one micro-batch's canonical activation block on
        this rank for sequences of T positions; T_c is this rank's share of
        them (T/cp under --cp, T/tp under --sequence-parallel, both
        divide), the rows the step driver cut for it."""
        return len(self.layout.canonical_seqs), canonical_length(self.layout, T), len(self.layout.canonical_cols)

    def _post_receives(self, actions, T: int) -> dict:
        shape, dtype = self._block_shape(T), self.layout.backend.dtype
        return {(a.op, a.micro, a.chunk): irecv(self.pp, shape, dtype, a.peer, self._tag(a))
                for a in actions if a.op.startswith("recv")}

    # --- one step -----------------------------------------------------------
    def forward_backward(self, parts, x, y, step: int, loss_scale: float = 1.0, after_forward=None) -> float:
        """x, y (B, T): the step's global batch. Runs this stage's action
        list; returns the step's mean loss (the same on every rank).
        ``after_forward(m, v)``, if given, runs after each forward (tests
        measure memory there); ``peak_saved`` is then the most this stage
        held for backward at once."""
        posted = self._post_receives(self.actions, x.shape[1])
        inbox, outbox, sends, loss = {}, {}, [], np.zeros(1 + self.cfg.mtp_depth)   # main, then each MTP depth
        live = set()
        self.peak_saved = (0, 0)
        self.recompute_peak_elements = self.recompute_peak_bytes = 0
        for a in self.actions:
            m, v = a.micro, a.chunk
            if a.op.startswith("recv"):
                inbox[a.op, m, v] = posted.pop((a.op, m, v)).wait()             # (B_c, T, C_c)
            elif a.op.startswith("send"):
                sends.append(isend(self.pp, outbox.pop((a.op, m, v)), a.peer, self._tag(a)))
            elif a.op == "forward":
                model = self.chunk_model(v)
                if model.first:
                    inp = None
                elif v in self.local_prev:                          # the chunk before, on this stage
                    inp = outbox.pop(("send_act", m, self.local_prev[v]))
                else:
                    inp = inbox.pop(("recv_act", m, v))
                out, self.tapes[v, m], ctx = self._run_forward(model, v, m, parts, x, y, step, inp)
                if ctx.router is not None and v == self.V - 1:
                    ctx.router.start(self.layout.axes.world, same_tokens(self.layout))   # waited in backward
                if model.last:
                    loss += self._share(out, ctx)
                else:
                    outbox["send_act", m, v] = out                               # (B_c, T, C_c)
                live.add((v, m))
                if after_forward is not None:
                    after_forward(m, v)
                    self._measure(live)
            elif a.op == "backward_weight":               # W: the weight work B filed (parallel/wgrad.py)
                self.store.wgrads.run(self.filed.pop((v, m)))
            elif a.op in ("backward", "backward_input"):
                model = self.chunk_model(v)
                if model.last:
                    dout = loss_scale
                elif v in self.local_next:                          # the chunk after, on this stage
                    dout = outbox.pop(("send_grad", m, self.local_next[v]))                # (B_c, T, C_c)
                else:
                    dout = inbox.pop(("recv_grad", m, v))                                 # (B_c, T, C_c)
                held = self._saved(live) if after_forward is not None else (0, 0)
                self._rerun = (0, 0)
                tape = self.tapes.pop((v, m))
                if tape.ctx.router is not None:
                    tape.ctx.router.wait()
                    tape.ctx.router.scale = loss_scale
                if a.op == "backward":
                    dx = model.backward(dout, tape)
                else:                                   # B: dX now, the linears' dW filed for W
                    with self.store.wgrads.collect() as self.filed[v, m]:
                        dx = model.backward(dout, tape)
                live.discard((v, m))
                self.recompute_peak_elements = max(self.recompute_peak_elements, self._rerun[0])
                self.recompute_peak_bytes = max(self.recompute_peak_bytes, self._rerun[1])
                if after_forward is not None and self._rerun[0]:
                    # --recompute blocks: a rerun block's caches on top of what was held before
                    self._peak((held[0] + self._rerun[0], held[1] + self._rerun[1]))
                if after_forward is not None and a.op == "backward_input":
                    self._measure(live)                 # the tapes left and every filed weight phase
                if not model.first:
                    outbox["send_grad", m, v] = dx                               # (B_c, T, C_c)
            else:
                raise ValueError(f"unknown pipeline action {a}")
        for pending in sends:
            pending.wait()
        if posted or inbox or outbox or self.filed:
            raise RuntimeError(f"stage {self.stage}: the action list left messages unused: "
                               f"{sorted(set(posted) | set(inbox) | set(outbox) | set(self.filed))[:3]}")
        ledgers = [self.ledgers.pop((True, m)) for m in sorted(m for t, m in self.ledgers if t)]
        self.ledgers.clear()
        axes = self.layout.axes
        head_stage = chunk_place(self.schedule, self.last_chunk, self.P)[0]
        once = self.stage == head_stage and axes.tp.rank == axes.dp.rank == axes.cp.rank == 0
        for ledger in ledgers:                  # the router losses, once in the world (its totals are global)
            self.router_log.add(ledger)
            if once:
                loss[0] += ledger.aux_term() + ledger.z_term() + ledger.seq_aux_term()
        return self._step_loss(loss, train=True)

    def _measure(self, live) -> None:
        self._peak(self._saved(live))

    def _saved(self, live) -> tuple:
        """(elements, bytes) the live (chunk, micro-batch) pairs hold for
        backward, and the weight work filed for a later W (its operands:
        the linears' saved inputs and output gradients)."""
        elems = nbytes = 0
        params = self.store.buffers()
        held = [self.tapes[v, m] for v, m in live] + [[ops for _, ops in f] for f in self.filed.values()]
        for item in held:
            buffers = saved_buffers(item, params)
            elems += sum(b.size for b in buffers)
            nbytes += sum(b.nbytes for b in buffers)
        return elems, nbytes

    def _peak(self, held) -> None:
        """Elements and bytes peak apart (the peak of one need not be the other's)."""
        self.peak_saved = (max(self.peak_saved[0], held[0]), max(self.peak_saved[1], held[1]))

    def _step_loss(self, share, train: bool = False) -> float:
        """The last stage's loss shares (1 + D,) summed over every rank (the
        other stages add zero): one float64 all-reduce per step. The step's
        loss is main + (W / D) sum_k L_k; a training step's main and depth
        losses go to ``mtp_log``; an evaluation's loss is the main one."""
        xp = self.layout.backend.xp
        sums = self.layout.backend.to_host(self.layout.axes.world.allreduce(xp.asarray(np.asarray(share))))
        if len(sums) == 1:
            return float(sums[0])
        main, depths = float(sums[0]), [float(v) for v in sums[1:]]
        if not train:                           # evaluation: the model's cross-entropy, as the Runner's
            return main
        self.mtp_log.add(main, depths)
        return main + self.cfg.mtp_loss_weight / self.cfg.mtp_depth * sum(depths)

    # --- forward only (evaluation) --------------------------------------------
    def forward_actions(self) -> list:
        """This stage's forward-only list: micro-batches in order, each
        through the chunks in order. Every dependency runs from (m, k-1) to
        (m, k), and each stage's list follows the order of (m, k), so it
        completes."""
        P, last, out = self.P, self.last_chunk, []
        for m in range(self.N):
            for v, k, _ in self.chunks:
                if k > 0 and v not in self.local_prev:
                    out.append(Action("recv_act", m, v, chunk_place(self.schedule, k - 1, P)[0]))
                out.append(Action("forward", m, v))
                if k < last and v not in self.local_next:
                    out.append(Action("send_act", m, v, chunk_place(self.schedule, k + 1, P)[0]))
        return out

    def forward_loss(self, parts, x, y, step: int = 0) -> float:
        """The step's mean loss over the global batch x, y (B, T), forward
        only and without dropout (evaluation's view)."""
        actions = self.forward_actions()
        posted = self._post_receives(actions, x.shape[1])
        sends, outbox, loss = [], {}, np.zeros(1 + self.cfg.mtp_depth)
        for a in actions:
            m, v = a.micro, a.chunk
            if a.op == "recv_act":
                inp = posted.pop((a.op, m, v)).wait()
            elif a.op == "send_act":
                sends.append(isend(self.pp, outbox.pop((m, v)), a.peer, self._tag(a)))
            else:
                model = self.chunk_model(v)
                if v in self.local_prev:                            # the chunk before, on this stage
                    inp = outbox.pop((m, self.local_prev[v]))
                out, _, ctx = self._run_forward(model, v, m, parts, x, y, step, None if model.first else inp,
                                                train=False)
                if model.last:
                    loss += self._share(out, ctx)
                else:
                    outbox[m, v] = out
        for pending in sends:
            pending.wait()
        self.ledgers.clear()                    # evaluation: no router losses, no backward to wait in
        return self._step_loss(loss)

    # --- generation: the stages in turn ---------------------------------------
    @property
    def embedding(self):
        """The LM head's embedding on the last stage (its logits' rows and
        vocabulary block: wte, or an untied model's lm_head), None on the others."""
        model = self.chunk_model(self.V - 1)
        return model.head_embedding if model.last else None

    def new_caches(self, positions: int = None) -> dict:
        """{local chunk: its blocks' key/value caches} over ``positions`` (GPT.new_caches)."""
        return {v: self.chunk_model(v).new_caches(positions) for v in range(self.V)}

    def decode(self, idx, pos: int, caches: dict):
        """``GPT.decode`` through every stage in turn: logits (B_l, t, V_l)
        on the last stage, None on the others."""
        return self._in_turn(idx, lambda model, v, x: model.decode(x, pos, caches[v]), idx.shape[1])

    def full_logits(self, idx):
        """The training forward's logits of idx (B_dp, T) on the last
        stage (None on the others): the reference for ``decode``."""
        def run(model, v, x):
            ids, targets, ctx = micro_context(self.layout, idx, np.zeros(idx.shape, dtype=np.int64), 0, 0, 1,
                                              train=False)
            if model.last:
                return last_logits(model, ids if model.first else x, targets, ctx)
            return model.forward(ids if model.first else x, targets, ctx)[0]
        return self._in_turn(idx, run, canonical_length(self.layout, idx.shape[1]))

    def _in_turn(self, idx, fn, rows: int):
        """Chunks 0..PV-1 one after another, each stage waiting for the one
        before it (one micro-batch: nothing to overlap). ``rows``: the
        positions of the activation a chunk passes on (decode's t new
        ones, or a training forward's canonical rows)."""
        result, carry, sends = None, None, []
        for v, k, _ in self.chunks:
            model = self.chunk_model(v)
            if k == 0:
                x = idx
            elif v in self.local_prev:                              # the chunk before, on this stage
                x = carry
            else:
                a = Action("recv_act", 0, v, chunk_place(self.schedule, k - 1, self.P)[0])
                shape = (len(self.layout.canonical_seqs), rows, len(self.layout.canonical_cols))
                x = irecv(self.pp, shape, self.layout.backend.dtype, a.peer, self._tag(a)).wait()   # (B_c, t, C_c)
            out = fn(model, v, x)
            if k == self.last_chunk:
                result = out
            elif v in self.local_next:
                carry = out
            else:
                a = Action("send_act", 0, v, chunk_place(self.schedule, k + 1, self.P)[0])
                sends.append(isend(self.pp, out, a.peer, self._tag(a)))
        for pending in sends:
            pending.wait()
        return result
