"""Hostile traces for ``mpicube compare`` (issue 44, classes 1 to 4), made
from a good one the way a careless writer or an attacker would.

The checker's whole job is to fail closed, so each case names what compare
must do with it: exit 1 with its verdict line (a comparison that compared
nothing, a step declared but absent), or exit 2 with one ``error:`` line
naming the attribute or dataset (a file that is not a self-contained trace,
or not readable as one); or, for odd but valid input, exit 0. None may take
more than 10 CPU seconds or 1 GiB, open a file outside the trace (each
outside target lives in ``outside/``: the test watches it with strace), or
leave anything behind.

``make_cases(root)`` writes them all under ``root`` and returns ``Case``s;
as a script, ``python tests/hostile_traces.py CASES.json`` runs
``python -m mpicube.check``'s entry point on each ``argv`` in this one
process and prints, per case, its status, output lines, wall and CPU
seconds, and the process's peak address space.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from mpicube.check import names
from mpicube.check.shards import Shard, Sharded
from mpicube.check.writer import TraceWriter

CFG = {"vocab_size": 16, "n_ctx": 4, "n_layer": 1, "n_head": 2, "n_embd": 8}
B, T, STEPS = 2, 4, 2
OPTIMIZER = {"name": "AdamW", "lr": {"peak": 1e-3, "warmup": 1, "steps": STEPS, "min_lr": 1e-4,
                                     "values": [1e-3, 1e-4]}, "betas": [0.9, 0.95], "eps": 1e-8,
             "weight_decay": 0.1, "decay": [], "grad_clip": {"max_norm": 1.0}}
TENSOR = "step_1/act/emb"         # (B, T, n_embd) float64: the tensor the storage cases replace


@dataclass
class Case:
    name: str
    argv: list          # after ``python -m mpicube.check``
    status: int         # the exit status compare must give
    expect: str         # regex: the one error line (status 2) or the verdict line (1); "" for 0


def write_good(path: Path, seed: int = 0, sharded: bool = False) -> Path:
    """A complete float64 trace of STEPS steps, random values (the same for
    the same seed); ``sharded``: every weight gradient as two column blocks."""
    rng = np.random.default_rng(seed)
    shapes = names.param_shapes(CFG)

    def tensors():
        return {n: rng.standard_normal(s) for n, s in shapes.items()}

    def split(g):
        if g.ndim != 2:
            return g
        n = g.shape[1] // 2
        return Sharded(g.shape, [Shard(0, (slice(None), slice(0, n)), g[:, :n]),
                                 Shard(1, (slice(None), slice(n, None)), g[:, n:])])
    with TraceWriter(path, CFG, OPTIMIZER, "float64", {"framework": "hostile"}) as w:
        w.init(tensors())
        for s in range(1, STEPS + 1):
            grads = tensors()
            w.step(s, loss=2.5 + s, lr=OPTIMIZER["lr"]["values"][s - 1], grad_norm=1.5,
                   grads={k: split(v) for k, v in grads.items()} if sharded else grads, params=tensors(),
                   acts={k: rng.standard_normal((B, T, CFG["n_embd"])) for k in names.act_names(CFG)},
                   logits=rng.standard_normal((B, T, CFG["vocab_size"])),
                   tokens=rng.integers(0, CFG["vocab_size"], (B, T + 1)))
    return path


def variant(good: Path, path: Path, edit) -> Path:
    """A copy of ``good`` changed by ``edit(f)`` (an h5py File open r+)."""
    shutil.copyfile(good, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def bare(path: Path, steps=0, **attrs) -> Path:
    """A trace that holds no tensor at all: the root attributes only."""
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": names.FORMAT, "version": names.VERSION, "config": json.dumps(CFG),
                        "optimizer": json.dumps(OPTIMIZER), "dtype": "float64", "steps": steps, **attrs})
    return path


def replace(f, name: str, make) -> None:
    """Dataset ``name`` deleted and made again by ``make(f, name, data)``."""
    data = f[name][()]
    del f[name]
    make(f, name, data)


def make_cases(root: Path) -> list:
    root = Path(root)
    outside = root / "outside"               # what no case may open
    outside.mkdir(parents=True, exist_ok=True)
    good = write_good(root / "good.h5")
    same = write_good(root / "same.h5")      # the same values, another file
    sharded = write_good(root / "sharded.h5", sharded=True)
    cases = [Case("good-vs-itself", [good, same], 0, ""), Case("good-vs-sharded", [good, sharded], 0, "")]
    emb = None
    with h5py.File(good, "r") as f:
        emb = f[TENSOR][()]
    secret = outside / "secret.bin"          # holds exactly the tensor's bytes: read, it would agree
    secret.write_bytes(emb.tobytes())
    outer_h5 = outside / "outer.h5"
    with h5py.File(outer_h5, "w") as f:
        f[TENSOR] = emb
    os.mkfifo(outside / "fifo")

    def v(name, edit):
        return variant(good, root / f"{name}.h5", edit)

    def case(name, edit, status, expect, *flags, a=good):
        cases.append(Case(name, [a, v(name, edit), *flags], status, expect))

    # 1. a comparison that compared nothing fails, whatever is allowed missing
    empty = bare(root / "empty.h5")
    cases += [
        Case("empty-allowed-star", [good, empty, "--allow-missing", "*"], 1,
             r"first divergence: \(comparison\) \(nothing was compared"),
        Case("two-empty-steps-0", [empty, bare(root / "empty2.h5")], 1,
             r"first divergence: \(comparison\) \(nothing was compared"),
    ]

    def only_loss(f):
        for key in list(f):
            del f[key]
        f["step_1/loss"] = 3.5
        f.attrs["steps"] = 1
    cases.append(Case("only-loss-allowed-star", [good, v("only-loss", only_loss), "--allow-missing", "*"], 1,
                      r"first divergence: step_1 \(.*nothing of step 1's activations, gradients and parameters"))

    # 2. sizes declared in the file do not drive memory
    case("steps-2^40", lambda f: f.attrs.__setitem__("steps", 2 ** 40), 1,
         r"first divergence: step_3 \(steps 3 to 1099511627776 declared by B's steps attribute", "--allow-missing",
         "step_*")
    case("steps-10^7", lambda f: f.attrs.__setitem__("steps", 10 ** 7), 1,
         r"first divergence: step_3 \(steps 3 to 10000000 declared by B's steps attribute")
    case("step-30-digits", lambda f: f.__setitem__("step_" + "9" * 30 + "/loss", 1.0), 1,
         r"first divergence: step_9{30} \(step 9{30} only in B")
    case("unwritten-2^28", lambda f: replace(f, TENSOR, lambda g, n, d: g.create_dataset(
        n, shape=(2 ** 28,), dtype="f8", chunks=(2 ** 20,))), 2,
         r"dataset step_1/act/emb: its storage was never \(fully\) written")
    case("unwritten-2^40", lambda f: replace(f, TENSOR, lambda g, n, d: g.create_dataset(
        n, shape=(2 ** 20, 2 ** 20), dtype="f8", chunks=(1024, 1024))), 2,
         r"dataset step_1/act/emb: its storage was never \(fully\) written")

    def declared_2_27(f):
        del f[TENSOR]
        g = f.create_group(TENSOR)
        g.attrs["sharded"], g.attrs["shape"] = 1, np.array([2 ** 27], np.int64)
        m = g.create_group("rank0")
        m.attrs["rank"] = 0
        m["data"], m["index_0"] = np.zeros(1), np.zeros(1, np.int64)
    lying = v("sharded-2^27", declared_2_27)
    cases.append(Case("sharded-2^27-vs-itself", [lying, lying], 1,
                      r"first divergence: step_1/act/emb \(A: at least 134,217,727 elements held by no rank"))
    cases.append(Case("sharded-2^27-vs-good", [good, lying], 1,
                      r"first divergence: step_1/act/emb \(shapes \(2, 4, 8\) vs \(134217728,\)"))

    def placed_2_27(f):                      # the same, its block placed on a mesh (format 3, placements.py)
        declared_2_27(f)
        f.attrs["mesh"] = json.dumps({"axes": ["tp"], "sizes": [2]})
        f[TENSOR + "/rank0"].attrs["placement"], f[TENSOR + "/rank0"].attrs["coords"] = "P", np.zeros(1, np.int64)
    placed = v("placed-2^27", placed_2_27)
    cases.append(Case("placed-2^27-vs-itself", [placed, placed], 1,
                      r"first divergence: step_1/act/emb \(A: at least 134,217,727 elements held by no rank"))

    def placed_bad_shape(f):
        placed_2_27(f)
        f[TENSOR].attrs["shape"] = np.array([2.5])
    case("placed-shape-not-sizes", placed_bad_shape, 2,
         r"sharded tensor step_1/act/emb: its 'shape' attribute .* is not a list of sizes")
    case("shape-differs", lambda f: replace(f, TENSOR, lambda g, n, d: g.create_dataset(
        n, data=np.zeros(2 ** 10))), 1, r"first divergence: step_1/act/emb \(shapes \(2, 4, 8\) vs \(1024,\)")

    # 3. attributes and datasets compare cannot read: one line naming them
    cfg_text = json.dumps(CFG)
    case("config-infinity", lambda f: f.attrs.__setitem__("config", cfg_text.replace("16,", "Infinity,", 1)), 2,
         r"the 'config' attribute is not JSON \(Infinity is not a JSON number\)")
    case("config-1e400", lambda f: f.attrs.__setitem__("config", cfg_text.replace("16,", "1e400,", 1)), 2,
         r"the 'config' attribute holds a size that is not an integer \(vocab_size\)")
    case("config-nested-5000", lambda f: f.attrs.__setitem__(
        "config", cfg_text[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}"), 2,
         r"the 'config' attribute is nested too deeply")
    case("dropout-abc", lambda f: f.attrs.__setitem__("dropout", "abc"), 2,
         r"the 'dropout' attribute 'abc' is not a probability")
    case("version-inf", lambda f: f.attrs.__setitem__("version", float("inf")), 2, r"trace version inf")
    case("string-dataset", lambda f: replace(f, "step_1/loss", lambda g, n, d: g.__setitem__(n, "3.5")), 2,
         r"dataset step_1/loss holds object values, not numbers")
    case("compound-dataset", lambda f: replace(f, TENSOR, lambda g, n, d: g.create_dataset(
        n, data=np.zeros(3, dtype=[("a", "f8"), ("b", "i4")]))), 2, r"dataset step_1/act/emb holds .* not numbers")

    # 4. a trace is one self-contained file
    def external(target):
        return lambda f: replace(f, TENSOR, lambda g, n, d: g.create_dataset(
            n, shape=d.shape, dtype=d.dtype, external=[(str(target), 0, h5py.h5f.UNLIMITED)]))
    case("external-storage", external(secret), 2, r"dataset step_1/act/emb: its bytes are stored in the external "
         r"file .*secret.bin \(refused\)")
    case("external-storage-fifo", external(outside / "fifo"), 2, r"stored in the external file .*fifo")
    case("external-storage-relative", external(os.path.relpath(secret, root)), 2, r"external file outside/secret.bin")

    def virtual(source):
        def edit(f):
            layout = h5py.VirtualLayout(shape=emb.shape, dtype=emb.dtype)
            layout[...] = h5py.VirtualSource(str(source), TENSOR, shape=emb.shape)
            del f[TENSOR]
            f.create_virtual_dataset(TENSOR, layout)
        return edit
    case("vds-absolute", virtual(outer_h5), 2, r"dataset step_1/act/emb: is a virtual dataset")
    case("vds-relative", virtual(os.path.relpath(outer_h5, root)), 2, r"is a virtual dataset")
    case("vds-self", virtual("."), 2, r"is a virtual dataset")

    def elink(f):
        del f[TENSOR]
        f[TENSOR] = h5py.ExternalLink(str(outer_h5), TENSOR)
    case("external-link", elink, 2, r"step_1/act/emb is an external link to .*outer.h5")

    def soft(f):
        del f["step_2/act/emb"]
        f["step_2/act/emb"] = h5py.SoftLink("/" + TENSOR)
    case("soft-link", soft, 2, r"step_2/act/emb is a soft link to /step_1/act/emb")

    def member_elink(f):
        grad = "step_1/grad/h.0.attn.c_attn.weight"
        with h5py.File(outer_h5, "a") as o:
            o.copy(f[grad + "/rank1"], "rank1")
        del f[grad + "/rank1"]
        f[grad + "/rank1"] = h5py.ExternalLink(str(outer_h5), "rank1")
    def member_compressed(f):                # 2^31 zeros in 256 gzip chunks of 64 MiB: 16 GiB in about 16 MiB
        grad = "step_1/grad/h.0.attn.c_attn.weight"
        rows, cols, chunk_rows = 2 ** 15, 2 ** 16, 128
        f[grad].attrs["shape"] = np.array([rows, cols], np.int64)
        for key in list(f[grad]):
            del f[grad + "/" + key]
        member = f.create_group(grad + "/rank0")
        member.attrs["rank"] = 0
        data = member.create_dataset("data", shape=(rows, cols), dtype="f8", chunks=(chunk_rows, cols),
                                     compression="gzip")
        zeros = zlib.compress(bytes(8 * chunk_rows * cols))
        for start in range(0, rows, chunk_rows):
            data.id.write_direct_chunk((start, 0), zeros)
        member["index_0"], member["index_1"] = np.arange(rows), np.arange(cols)
    bomb = variant(sharded, root / "member-gzip.h5", member_compressed)
    cases.append(Case("sharded-member-compressed-2^31-vs-itself", [bomb, bomb], 2,
                      r"step_1/grad/h.0.attn.c_attn.weight/rank0: its block is stored compressed"))
    cases.append(Case("sharded-member-external-link", [good, variant(sharded, root / "member-elink.h5",
                                                                     member_elink)], 2,
                      r"step_1/grad/h.0.attn.c_attn.weight/rank1 is an external link"))
    return cases


# --------------------------------------------------------------------------- run as a script


def vm_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def run(argv) -> dict:
    import contextlib
    import io

    from mpicube.check.report import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(a) for a in argv])
        except BaseException:          # noqa: BLE001 - a traceback is what the test must see
            traceback.print_exc()
            status = -1
    return {"status": status, "out": out.getvalue().splitlines(), "err": err.getvalue().splitlines()}


if __name__ == "__main__":
    results = []
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        t0, c0 = time.monotonic(), cpu_seconds()
        result = run(argv)
        result.update(seconds=time.monotonic() - t0, cpu=cpu_seconds() - c0)
        results.append(result)
    print(json.dumps({"results": results, "vm_peak": vm_peak()}))
