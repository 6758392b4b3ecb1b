"""--optimizer muon (mpicube.training.muon) against an independent PyTorch
Muon written here from the published algorithm (Keller Jordan, 2024:
Nesterov momentum, 5 iterations of the quintic Newton-Schulz with
coefficients (3.4445, -4.7750, 2.0315) on the orientation with fewer rows
after a Frobenius normalisation, the update scaled by
sqrt(max(1, rows / cols)) of PyTorch's (out, in) weight; torch.optim.AdamW
for everything that is not a hidden matrix): 3 steps of the serial model
in float64 with dropout, GPT-2 with q, k, v orthogonalised split and
joint, and Llama with grouped-query attention and SwiGLU, parameters and
moments equal to 1e-10. Every layout and ZeRO stage equals the serial
Muon in tests/test_combo_matrix.py (MUON_CASES), so each equals this
PyTorch Muon too. Skipped without torch. The bad input: one line, exit 2."""

import numpy as np
import pytest

from mpicube.core.config import ModelConfig
from mpicube.training import muon

torch = pytest.importorskip("torch")

LR, WD, BETA, STEPS = 0.02, 0.1, 0.95, 3


def torch_newton_schulz(G):
    """The quintic iteration on a (rows, cols) torch matrix, as published."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.clone()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


class TorchMuon:
    """Muon on the listed (out, in) matrices (each given as its row groups:
    the stacked matrices it orthogonalises apart), AdamW on the rest."""

    def __init__(self, hidden: dict, rest: dict, decayed: set):
        self.hidden, self.rest = hidden, rest           # name -> (tensor, row groups) / name -> tensor
        self.buf = {n: torch.zeros_like(t) for n, (t, _) in hidden.items()}
        groups = [{"params": [t for n, t in rest.items() if n in decayed], "weight_decay": WD},
                  {"params": [t for n, t in rest.items() if n not in decayed], "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=(0.9, 0.95), eps=1e-8)

    @torch.no_grad()
    def step(self, grads: dict):
        for name, p in self.rest.items():
            p.grad = grads[name]
        self.adam.step()
        for name, (p, rows) in self.hidden.items():
            g, buf = grads[name], self.buf[name]
            buf.lerp_(g, 1 - BETA)
            u = g.lerp(buf, BETA)
            update = torch.empty_like(u)
            for lo, hi in rows:
                part = u[lo:hi]
                update[lo:hi] = torch_newton_schulz(part) * max(1.0, part.size(-2) / part.size(-1)) ** 0.5
            p.mul_(1 - LR * WD)
            p.add_(update, alpha=-LR)


def test_newton_schulz_matches_the_published_iteration():
    rng = np.random.default_rng(0)
    for shape in ((8, 8), (6, 20), (20, 6)):
        G = rng.standard_normal(shape)
        want = torch_newton_schulz(torch.from_numpy(G)).numpy()
        assert np.abs(muon.newton_schulz(G) - want).max() < 1e-12


def _rows(decl, qkv):
    """PyTorch row groups of a mpicube (in, out) weight: its stacked matrices under split."""
    n_out = decl.shape[1]
    if qkv == "joint" or decl.groups == 1:
        return [(0, n_out)]
    sizes = list(decl.groups) if isinstance(decl.groups, tuple) else [n_out // decl.groups] * decl.groups
    ends = np.cumsum(sizes)
    return list(zip(ends - sizes, ends))


@pytest.mark.parametrize("arch,qkv", [("gpt2", "split"), ("gpt2", "joint"), ("llama", "split")])
def test_muon_equals_an_independent_pytorch_muon(arch, qkv):
    from mpi4py import MPI

    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics, build_parts
    from mpicube.training.step import make_step

    extra = dict(arch="llama", n_kv_head=2, ffn_hidden=24, rope_theta=100.0, rms_eps=1e-5) if arch == "llama" else {}
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=16, **extra)
    parts = build_parts(resolve(Plan("serial"), cfg, 4, 1), MPI.COMM_SELF, Numerics("float64"), seed=7, dropout=0.1)
    store = parts.store
    opt = make_step(store, parts.layout.axes, weight_decay=WD, optimizer="muon", muon_qkv=qkv)
    hidden, rest, decayed = {}, {}, set()
    for spec in store.specs:
        value = torch.from_numpy(store.data[spec.name].copy())
        if muon.is_hidden_matrix(spec.decl):
            hidden[spec.name] = (value.T.contiguous(), _rows(spec.decl, qkv))     # PyTorch's (out, in)
        else:
            rest[spec.name] = value
            decayed |= {spec.name} if spec.decl.decay else set()
    assert hidden and rest
    ref = TorchMuon(hidden, rest, decayed)
    rng = np.random.default_rng(3)
    for step in range(1, STEPS + 1):
        x, y = rng.integers(0, 61, (4, 16)), rng.integers(0, 61, (4, 16))
        store.zero_grad()
        parts.model.forward(x, y, step=step)
        parts.model.backward(loss_scale=1.0)
        opt.sync()
        scale = min(1.0, 1.0 / opt.grad_norm())                                  # clipping at 1, as train
        grads = {n: torch.from_numpy(store.grad[n] * scale) for n in store.grad}
        grads.update({n: grads[n].T.contiguous() for n in hidden})
        ref.step(grads)
        opt.step(LR, grad_scale=scale)
    for name, value in store.data.items():
        want = (hidden[name][0].T if name in hidden else rest[name]).numpy()
        err = np.abs(value - want).max() / np.abs(want).max()
        assert err < 1e-10, f"{name}: {err:.2e}"
    for name, (_, _) in hidden.items():                                          # Muon's momentum: optimizer/m
        lo, hi = store.offsets[name]
        want = ref.buf[name].T.numpy().reshape(-1)
        assert np.abs(opt.adam.m[lo:hi] - want).max() < 1e-10 * np.abs(want).max()


@pytest.mark.parametrize("arch,qkv", [("gpt2", "split"), ("llama", "split")])
def test_muon_temporaries_are_in_the_memory_model(arch, qkv):
    """The memory model prices Muon's step temporaries with the optimizer
    state (``analysis.costmuon``: the Nesterov update and the update
    buffer, one whole matrix, its result and Newton-Schulz's workspace):
    within 10 % of the peak tracemalloc sees during ``Muon._muon`` on a
    serial float64 store, and the optimizer state is the moments plus it."""
    import tracemalloc

    from mpi4py import MPI

    from mpicube.analysis.costbase import Problem
    from mpicube.analysis.costmemory import step_memory
    from mpicube.analysis.costmuon import muon_workspace
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics, build_parts
    from mpicube.training.step import make_step

    extra = dict(arch="llama", n_kv_head=2, ffn_hidden=24, rope_theta=100.0, rms_eps=1e-5) if arch == "llama" else {}
    cfg = ModelConfig(vocab_size=61, n_ctx=16, n_layer=2, n_head=4, n_embd=16, **extra)
    parts = build_parts(resolve(Plan("serial"), cfg, 4, 1), MPI.COMM_SELF, Numerics("float64"), seed=7)
    opt = make_step(parts.store, parts.layout.axes, weight_decay=WD, optimizer="muon", muon_qkv=qkv)
    x = np.random.default_rng(3).integers(0, 61, (2, 4, 16))
    parts.model.forward(x[0], x[1], step=1)
    parts.model.backward(loss_scale=1.0)
    opt.sync()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        opt.adam._muon(LR, 1.0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    p = Problem(cfg, "serial", 1, 1, 1, 4, 16, "float64", optimizer="muon")
    model = muon_workspace(p, qkv) * 8
    params = sum(s.size for s in parts.store.specs)
    assert model > 2 * params * 8                       # more than the two flat buffers: the matrices count
    assert abs(model - peak) <= 0.1 * peak, (model, peak)
    assert step_memory(p).optimizer == 2 * params + muon_workspace(p)


def test_resume_carries_the_momentum_and_bad_input(mpicube, tiny_shard):
    """train --optimizer muon for 3 steps equals 1 step, a checkpoint and a
    resumed 2 (the momentum travels in optimizer/m, on a 2-rank 1-D run
    for the second half); Muon with a mixture of experts is
    one line and exit 2, with no run directory left."""
    import json

    from conftest import TINY

    args = [*TINY[2:], "--dtype", "float64", "--dropout", "0.1", "--steps", "3", "--optimizer", "muon",
            "--data", str(tiny_shard), "--n-head", "2", "--lr", "0.02"]
    r = mpicube.run("train", *args, "--layout", "serial", "--out", "whole")
    assert r.returncode == 0, r
    r = mpicube.run("train", *args, "--layout", "serial", "--out", "split", "--stop-after", "1")
    assert r.returncode == 0, r
    r = mpicube.run("train", *args, "--layout", "1d", "--dp", "1", "--out", "split", "--resume", n=2)
    assert r.returncode == 0, r

    def last(run):
        return json.loads((mpicube.cwd / run / "metrics.jsonl").read_text().splitlines()[-1])
    whole, resumed = last("whole"), last("split")
    assert whole["step"] == resumed["step"] == 3
    assert abs(whole["loss"] - resumed["loss"]) <= 1e-10 * abs(whole["loss"])
    r = mpicube.run("train", *args, "--arch", "llama", "--n-experts", "4", "--out", "bad")
    assert r.returncode == 2 and r.error_lines() == [
        "error: --optimizer muon does not orthogonalise a mixture's experts (their matrices are sharded over "
        "--ep): use --optimizer adamw with --n-experts, or drop --n-experts"], r
    assert not (mpicube.cwd / "bad").exists()


def test_the_page_shows_what_the_code_draws():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "tools/muon_pictures.py", "--check", "docs/muon.md"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
