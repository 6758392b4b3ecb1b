"""The parameter store: the one flat buffer per rank that holds every local
parameter block, its gradient and the views the model uses.

The model names each logical tensor once (``ParamDecl``); a layout answers
with a ``ParamSpec`` saying which global indices this rank holds and over
which communicator its gradient must be summed (both in ``paramspec``,
importable from here too). ``ParamStore`` lays all local
blocks out in one flat data buffer and one flat gradient buffer, so the
data-parallel all-reduce, the optimizer and gradient clipping each touch one
contiguous array instead of a hundred small ones.

Under mixed precision the data and gradient buffers are the float32 master
(what the optimizer updates and checkpoints hold) and a third buffer holds
the 16-bit working copy the model computes with (``work``): rounded from
the master once per optimizer step, lazily, before the next forward.

Under ``--zero 1`` (mpicube.parallel.zero) the buffers are padded to a multiple of
dp and the optimizer updates only this replica's chunk of them
(``master``, ``shard``); the step all-gathers the chunks afterwards. With
mixed precision the float32 master is then held as that chunk only, and
``flat``/``data`` do not exist: code outside the step reads and writes the
full master through ``full_master`` and ``writing_master``, which work in
every mode.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from ..device import fused, precision
from ..device.backend import Backend
from .comm import Comm
from .paramspec import ParamDecl, ParamSpec, init_block  # noqa: F401 (ParamDecl, ParamSpec re-exported)
from .wgrad import WeightGrads
from .split import SharedColumns, full_index, shared_columns, split_decl, split_index  # noqa: F401 (re-exported)
from .zero import ExpertPartition, Partition


class ResidentLayers:
    """The stream a model walks over its blocks (``ParamStore.layers``):
    ``enter(i)`` before block i runs, ``leave(i)`` after it, ``finish()``
    after a backward pass. Here every parameter and gradient is resident,
    so there is nothing to do; --zero 2 and 3 gather and send per block
    (``parallel.fsdp_stream.BlockStream``)."""

    def enter(self, i: int) -> None:
        pass

    def leave(self, i: int) -> None:
        pass

    def finish(self) -> None:
        pass


class ParamStore:
    """Every local parameter block of a rank in one flat buffer, with the
    gradient and the views the model uses."""

    streams_gradients = False       # --zero 2/3 (parallel.fsdp) reduce gradients during backward

    def __init__(self, specs: list, backend: Backend, seed: int, dp: Optional[Comm] = None, zero: int = 0,
                 edp: Optional[Comm] = None):
        # Parameters that share a gradient communicator sit next to each other,
        # so each group is summed by one all-reduce on a contiguous slice.
        def group_key(spec):
            return "" if spec.grad_comm is None else spec.grad_comm.axis

        # experts last, so that their gradients (summed over the expert-data group under --ep) are one run
        self.specs = sorted(specs, key=lambda s: (s.expert, group_key(s), not s.decl.decay))
        self.by_name = {s.name: s for s in self.specs}
        self.backend = backend
        xp, master = backend.xp, backend.master_dtype
        total = sum(s.size for s in self.specs)
        n_experts = sum(s.size for s in self.specs if s.expert)
        # --zero 1: the optimizer's share of the buffer is this replica's chunk (mpicube.parallel.zero);
        # with --ep (experts summed over fewer replicas than dp) the dense part's chunk over dp and the
        # experts' over the expert-data group, side by side in a (C,) chunk buffer
        self.dp = dp if zero else None
        split = bool(zero and dp is not None and edp is not None and edp is not dp and n_experts)
        if split:
            self.partition = ExpertPartition(total - n_experts, n_experts, dp, edp)
        else:
            self.partition = Partition(total, dp.size, dp.rank) if zero and dp is not None else Partition(total)
        self.shard = self.partition.own                  # the slice of the buffer this rank's optimizer updates
        self.zero = int(self.partition.sharded)          # the --zero setting this store implements (0 or 1)
        padded, mixed = self.partition.padded, backend.dtype != master
        self.flat_grad = xp.zeros(padded, dtype=master)  # (P_pad,) P_pad = P unless sharded
        # (C,) the summed gradient this rank's optimizer reads: a view of flat_grad, or its own buffer
        # when the owned chunks are not one slice of it (ExpertPartition)
        self.grad_chunk = xp.zeros(self.partition.chunk, dtype=master) if split else self.flat_grad[self.shard]
        if split:
            self._flat = None                                            # no full master (two windows)
            self.master = xp.zeros(self.partition.chunk, dtype=master)   # (C,) master chunk
            self.flat_work = xp.zeros(padded, dtype=backend.dtype)       # (P_pad,) working copy, gathered
        elif self.partition.sharded and mixed:
            # The float32 master exists only as this replica's chunk; the full
            # buffer is the 16-bit working copy, all-gathered after each step.
            self._flat = None
            self.master = xp.zeros(self.partition.chunk, dtype=master)   # (C,) master chunk
            self.flat_work = xp.zeros(padded, dtype=backend.dtype)       # (P_pad,) working copy
        else:
            self._flat = xp.zeros(padded, dtype=master)                  # (P_pad,) master weights
            # (P_pad,) the working copy in the storage format; the master itself when they agree
            self.flat_work = xp.zeros(padded, dtype=backend.dtype) if mixed else self._flat
            self.master = self._flat[self.shard]                         # (C,) what the optimizer updates
        self._work_stale = False
        self.offsets = {}
        self._data, self.grad, self.work = {}, {}, {}
        offset = 0
        for spec in self.specs:
            if split and spec.expert and offset < self.partition.dense.padded:
                offset = self.partition.dense.padded             # the experts' part starts after the dense padding
            self.offsets[spec.name] = (offset, offset + spec.size)
            if self._flat is not None:
                self._data[spec.name] = self._flat[offset:offset + spec.size].reshape(spec.local_shape)
            self.grad[spec.name] = self.flat_grad[offset:offset + spec.size].reshape(spec.local_shape)
            self.work[spec.name] = self.flat_work[offset:offset + spec.size].reshape(spec.local_shape)
            offset += spec.size
        self.grad_groups = self._contiguous_groups()
        experts = self._runs([s for s in self.specs if s.expert])
        self.expert_run = experts[0] if experts else None    # the experts' slice of the buffer (--ep), or None
        self._deferred, self._unwritten = set(), set()    # see defer_zero
        self.wgrads = WeightGrads()                       # the linears' dW: now, or filed (wgrad.py)
        self._eager_runs = None
        self.decay_slices = self._runs([s for s in self.specs if s.decl.decay])
        # (replicas, flat slice) runs: the gradient norm counts each replicated block once
        self.replica_runs = [(r, run) for r in sorted({s.replicas for s in self.specs})
                             for run in self._runs([s for s in self.specs if s.replicas == r])]
        self.initialize(seed)

    def persist(self, name: str, value, writer: bool) -> None:
        """Keep ``value``, a tensor of the model that is not a parameter
        (a mixture's balancing bias: no gradient, no weight decay, no
        optimizer state), whole on every rank under ``name``: checkpoints
        write it (under "buffers/", by the ranks whose ``writer`` is True on
        data-parallel rank 0) and a read puts it back bitwise."""
        self.persistent[name], self.persistent_writer[name] = value, bool(writer)

    @property
    def persistent(self) -> dict:
        """{name: tensor} kept by ``persist`` (every store kind, --zero 2/3's too)."""
        return self.__dict__.setdefault("_persistent", {})

    @property
    def persistent_writer(self) -> dict:
        """{name: whether this rank's tensor group writes it}."""
        return self.__dict__.setdefault("_persistent_writer", {})

    def _runs(self, specs) -> list:
        """Merge the flat ranges of ``specs`` into as few slices as possible."""
        runs = []
        for spec in specs:
            lo, hi = self.offsets[spec.name]
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        return [slice(lo, hi) for lo, hi in runs]

    def _contiguous_groups(self) -> list:
        """(comm, flat slice) for every run of the buffer that a gradient
        communicator sums: one each, unless the experts (kept last) part a
        communicator's parameters in two."""
        groups = {}
        for spec in self.specs:
            if spec.grad_comm is not None:
                groups.setdefault(spec.grad_comm.axis, (spec.grad_comm, []))[1].append(spec)
        return [(comm, run) for comm, specs in groups.values() for run in self._runs(specs)]

    def initialize(self, seed: int) -> None:
        """GPT-2 initialisation evaluated at this rank's global indices only."""
        with self.writing_master() as flat:
            for spec in self.specs:
                lo, hi = self.offsets[spec.name]
                flat[lo:hi] = self.backend.asarray(init_block(spec, seed).reshape(-1), dtype=flat.dtype)

    # --- the full master, for code outside the optimizer step -----------------
    # ``data`` and ``flat`` are the float32 master of every local block, full.
    # Under --zero 1 with mixed precision no full master exists (each replica
    # keeps its chunk, ``master``); readers and writers outside the step then
    # go through full_master / writing_master, which work in every mode.

    @property
    def flat(self):
        """(P_pad,) the full master buffer (not held under a sharded master)."""
        if self._flat is None:
            raise RuntimeError("the master weights are sharded over dp (--zero 1 with 16-bit storage): use "
                               "ParamStore.full_master() to read them, writing_master() to write them")
        return self._flat

    @property
    def data(self) -> dict:
        """{name: local block of the full master} (views of ``flat``)."""
        self.flat                                           # noqa: B018 (the clear error when sharded)
        return self._data

    def views(self, flat) -> dict:
        """{name: local block} of a full buffer laid out like ``flat``
        (e.g. what ``full_master`` returns)."""
        return {spec.name: flat[lo:hi].reshape(spec.local_shape)
                for spec in self.specs for lo, hi in [self.offsets[spec.name]]}

    def full_master(self):
        """(P_pad,) the full float32 master for a reader (a checkpoint save):
        the live buffer, or under a sharded master a temporary all-gathered
        over dp (P_pad float32 on each rank while the caller holds it).
        Collective under --zero 1: every rank of the dp group calls it."""
        if self._flat is not None:
            self.refresh_work()                             # --zero 1 at full width: gather chunks first
            return self._flat
        return self.gather_chunks(self.master)

    def gather_chunks(self, chunk):
        """(P_pad,) a full buffer from every replica's (C,) ``chunk`` of it
        (the master, a moment): collective over dp."""
        if isinstance(self.partition, ExpertPartition):
            return self.partition.gather(self.backend.xp, chunk)
        return self.partition.assemble(self.backend.xp, self.dp.allgather(chunk))

    def scatter_gradients(self, wire=None) -> None:
        """``grad_chunk`` = this replica's chunk of the gradient summed over
        the replicas (--zero 1: a reduce-scatter over dp; with --ep the
        experts' part over the expert-data group)."""
        if isinstance(self.partition, ExpertPartition):
            self.partition.scatter(self.flat_grad, self.grad_chunk, wire=wire)
        else:
            self.grad_chunk[...] = self.dp.reduce_scatter(self.flat_grad, wire=wire)

    @contextmanager
    def writing_master(self):
        """Yields a (P_pad,) full master for the caller to fill completely
        (initialisation, loading a model or checkpoint); afterwards the
        working copy is rounded from it afresh. Under a sharded master the
        buffer is a temporary of which this replica keeps its chunk, and the
        working copy is rounded from the full values directly: every replica
        wrote the same values, so nothing is gathered."""
        if self._flat is not None:
            yield self._flat
            self._work_stale = self.mixed                   # every replica wrote every chunk
            return
        full = self.backend.xp.zeros(self.partition.padded, dtype=self.master.dtype)   # (P_pad,) temporary
        yield full
        self.master[...] = self.partition.take(self.backend.xp, full)
        self.flat_work[...] = full
        self._work_stale = False

    def buffers(self) -> list:
        """Every parameter and gradient buffer this rank holds (distinct arrays)."""
        out = []
        for a in (self._flat if self._flat is not None else self.master, self.flat_grad, self.flat_work):
            if not any(a is b for b in out):
                out.append(a)
        return out

    def layers(self, direction: str, blocks: list, ends: bool = True) -> ResidentLayers:
        """The stream a forward or backward pass over ``blocks`` (their
        sites, "h.{i}", in the model's order; ``ends``: whether the pass
        runs the embeddings or the head too) walks: nothing to fetch here."""
        return ResidentLayers()

    def tied_chunk(self):
        """The tied wte's gradient chunk when it is a segment of its own
        (``fsdp.SegmentedStore``); here the whole ``grad["wte"]`` is summed."""
        return None

    # --- the working copy ---------------------------------------------------
    @property
    def mixed(self) -> bool:
        """Whether the model computes with a 16-bit copy of the master weights."""
        return self.backend.dtype != self.backend.master_dtype

    def params_changed(self) -> None:
        """Say that the master weights were written (optimizer step, load,
        initialisation): the working copy is rounded afresh before the next
        forward, and under --zero 1 the other replicas' chunks are gathered.
        Code that writes ``data`` or ``flat`` directly calls it too."""
        self._work_stale = self.mixed or self.partition.sharded

    def refresh_work(self) -> None:
        """Bring the full parameters the model reads up to date if the master
        changed since the last time: round it into the working copy (one
        pass per optimizer step), and under --zero 1 all-gather the chunks
        over dp (collective: the zero step calls it on every rank)."""
        if not self._work_stale:
            return
        if isinstance(self.partition, ExpertPartition):
            own = self.master.astype(self.flat_work.dtype, copy=False)   # (C,) rounded to the storage format
            self.flat_work[...] = self.gather_chunks(own)                # (P_pad,)
        elif self.partition.sharded:
            own = self.flat_work[self.shard]                # (C,)
            if self.mixed:
                own[...] = self.master                      # rounded to the storage format
            self.flat_work[...] = self.dp.allgather(own)    # (P_pad,)
        else:
            self.flat_work[...] = self._flat
        self._work_stale = False

    # --- gradients that skip zero_grad --------------------------------------
    # The linears' weight gradients are nearly the whole buffer. Clearing them
    # each step and then adding a GEMM's result into them streams that buffer
    # through memory three extra times; instead each is *deferred*: zero_grad
    # leaves it, and its first contribution of the step overwrites it.

    def defer_zero(self, name: str) -> None:
        """Let ``name``'s gradient skip zero_grad; every contribution to it
        must then come through add_grad or add_matmul."""
        self._deferred.add(name)
        self._eager_runs = None

    def zero_grad(self) -> None:
        """Start a step: gradients read as zero (deferred ones once written)."""
        if self._eager_runs is None:
            self._eager_runs = self._runs([s for s in self.specs if s.name not in self._deferred])
        for run in self._eager_runs:
            if fused.active(self.flat_grad[run]):
                fused.fill_zero(self.flat_grad[run])
            else:
                self.flat_grad[run] = 0
        self._unwritten = set(self._deferred)

    def add_grad(self, name: str, value) -> None:
        """grad[name] += value (a copy when it is the step's first contribution)."""
        if name in self._unwritten:
            self._unwritten.discard(name)
            self.grad[name][...] = value
        else:
            self.grad[name] += value

    def add_matmul(self, name: str, a, b) -> None:
        """grad[name] += a @ b (accumulated in float32 or better, whatever
        the operands' format); the step's first contribution is a GEMM
        written straight into the buffer."""
        if name in self._unwritten:
            self._unwritten.discard(name)
            precision.matmul(a, b, out=self.grad[name])
        else:
            self.grad[name] += precision.matmul(a, b, dtype=self.flat_grad.dtype)

    def grad_for_add(self, name: str):
        """The gradient view of ``name``, zeroed first if it is deferred and
        still unwritten, for code that adds into it in place (scatter-add)."""
        if name in self._unwritten:
            self._unwritten.discard(name)
            self.grad[name][...] = 0
        return self.grad[name]

    def settle(self) -> None:
        """Zero the deferred gradients nothing wrote this step, so the buffer
        is complete before it is summed, clipped or stepped on (the model's
        backward and every reader of the whole buffer call it; a no-op when
        all were written)."""
        for name in list(self._unwritten):
            self.grad_for_add(name)
