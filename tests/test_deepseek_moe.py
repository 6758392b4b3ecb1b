"""DeepSeekMoE as options of the mixture of experts (model/routers.py,
model/moe.py, docs/moe.md "DeepSeekMoE"): the sigmoid router with its
bias, group-limited top-k and scaling, shared experts, dense first
blocks, the sequence-wise auxiliary loss, through the mixtral family:
whole-model gradients against finite differences, the model against the
serial NumPy reference built from the ops (tests/deepseek_reference.py),
the bias update, and the one-line refusals."""

import os
import sys

import numpy as np
import pytest

from mpicube.core.config import ModelConfig

sys.path.insert(0, os.path.dirname(__file__))
rng = np.random.default_rng(43)


def deepseek_moe(**kw) -> ModelConfig:
    base = dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8, arch="llama", n_kv_head=1, ffn_hidden=6,
                n_experts=8, top_k=2, router="sigmoid", n_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                n_shared_experts=1, moe_ffn_hidden=4, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return ModelConfig(**{**base, **kw})


def random_biases(store):
    """A non-zero bias in every mixture, so that it steers the choice."""
    for name, bias in store.persistent.items():
        bias[...] = rng.normal(0, 0.3, bias.shape)


@pytest.mark.parametrize("kw", [dict(),
                                dict(seq_aux_loss_coef=0.3, first_k_dense=1, n_shared_experts=2),
                                dict(norm_topk=False, n_groups=1, topk_groups=1, top_k=3, capacity_factor=0.8,
                                     n_shared_experts=0, seq_aux_loss_coef=0.1)],
                         ids=["groups-shared", "seq-aux-dense-first", "no-norm-capacity"])
def test_whole_deepseek_moe_gradient(kw):
    """Every parameter's gradient (router, routed and shared experts, the
    dense first block, attention) with a random bias, dropout and the
    sequence-wise auxiliary loss on, against central differences."""
    from test_ops import check_whole_model_gradient

    cfg = deepseek_moe(**kw)
    assert check_whole_model_gradient(cfg, prepare=random_biases) == cfg.n_params()


def test_params_names_and_counts():
    from mpicube.model.gpt import gpt_params, param_names

    cfg = deepseek_moe(first_k_dense=1, n_shared_experts=2)
    decls = gpt_params(cfg)
    names = [d.name for d in decls]
    assert names == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    assert "h.0.mlp.c_fc.weight" in names and "h.0.moe.router.weight" not in names
    shapes = {d.name: d.shape for d in decls}
    assert shapes["h.1.moe.shared.c_fc.weight"] == (8, 2 * 2 * 4) and shapes["h.1.moe.shared.c_proj.weight"] == (8, 8)
    assert shapes["h.1.moe.experts.7.c_fc.weight"] == (8, 8)
    assert not any("score_bias" in n for n in names)                 # a buffer, not a parameter
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def run_cli(*args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "mpicube", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))


SMALL = ["--arch", "mixtral", "--n-experts", "8", "--top-k", "2", "--router", "sigmoid", "--n-groups", "4",
         "--topk-groups", "2", "--n-shared-experts", "1", "--moe-ffn-hidden", "8", "--first-k-dense", "1",
         "--bias-update-rate", "0.01", "--seq-aux-loss-coef", "0.01", "--routed-scaling-factor", "2.0",
         "--n-layer", "3", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "16", "--ffn-hidden", "24",
         "--seq-len", "8", "--batch-size", "4", "--dtype", "float64", "--steps", "4", "--ckpt-every", "2"]


# --arch deepseek_v3 with the same mixture and one multi-token prediction depth (its block h.3 a mixture
# too, its bias updated as the others'): the issue's "a checkpoint resumes bitwise" with MTP on
DS_SMALL = ["--arch", "deepseek_v3"] + SMALL[2:SMALL.index("--n-kv-head")] + SMALL[SMALL.index("--n-kv-head") + 2:] + [
    "--kv-lora-rank", "8", "--qk-rope-head-dim", "4", "--qk-nope-head-dim", "4", "--v-head-dim", "4",
    "--mtp-depth", "1", "--mtp-loss-weight", "0.5"]


@pytest.mark.parametrize("args,layers", [(SMALL, (1, 2)), (DS_SMALL, (1, 2, 3))], ids=["mixtral", "deepseek-mtp"])
def test_bias_moves_by_the_loads_and_resumes_bitwise(tmp_path, args, layers):
    """4 steps in one run, and 2 + 2 with --resume: every tensor of the last
    checkpoint equal bit for bit, the router biases (buffers/) included;
    each bias moved by rate x (sign sum) from the logged loads. With MTP:
    its depth's block and tensors too, its losses in metrics.jsonl."""
    import json

    from mpicube.files.checkpoint import open_checkpoint
    from mpicube.ops.deepseek_router import bias_update

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_cli("train", *args, "--out", str(whole)).returncode == 0
    assert run_cli("train", *args, "--out", str(part), "--stop-after", "2").returncode == 0
    proc = run_cli("train", *args, "--out", str(part), "--resume")
    assert proc.returncode == 0, proc.stderr
    with open_checkpoint(whole / "ckpt" / "step_00000004") as a, open_checkpoint(part / "ckpt" / "step_00000004") as b:
        names = list(a.names())
        assert sorted(n for n in names if n.startswith("buffers/")) == [
            f"buffers/h.{i}.moe.router.score_bias" for i in layers]
        assert (len(layers) == 3) == ("model/mtp.0.proj.weight" in names)
        for n in names:
            assert np.array_equal(a.read(n), b.read(n)), n
        got = {i: a.read(f"buffers/h.{i}.moe.router.score_bias") for i in layers}
        assert not any(n.startswith("model/h.") and "score_bias" in n for n in names)     # not a parameter
        assert not any("optimizer" in n and "score_bias" in n for n in names)
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    records = [r for r in records if "expert_tokens" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    want = {i: np.zeros(8) for i in layers}
    for r in records:                                   # the bias after each step, from that step's loads
        loads = np.array(r["expert_tokens"])            # (MoE layers, E)
        assert loads.shape == (len(layers), 8) and (loads.sum(1) == 4 * 8 * 2).all()
        assert r["seq_aux_loss"] > 0 and r["router_aux_loss"] == 0
        if len(layers) == 3:                            # MTP: loss = main + 0.5 / 1 x depth 1's
            assert abs(r["loss"] - r["main_loss"] - r["seq_aux_loss"] - 0.5 * r["mtp_loss_1"]) < 1e-12 * r["loss"]
        for row, i in enumerate(layers):
            want[i] = bias_update(want[i], loads[row], 0.01)
    for i in layers:
        assert np.array_equal(got[i], want[i]), (i, got[i], want[i])
        assert np.abs(got[i]).max() > 0
    # eval, --init-from and generate read a checkpoint's biases with its parameters (formats.load_params)
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.files import formats
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    with formats.open_model(whole / "ckpt" / "step_00000004") as model_file:
        cfg = model_file.config
        assert (cfg.router, cfg.n_groups, cfg.first_k_dense, cfg.bias_update_rate) == ("sigmoid", 4, 1, 0.01)
        assert cfg.mtp_depth == len(layers) - 2
        layout = build_layout(resolve("serial", cfg, 4, 1), make_backend("cpu", "float64"), MPI.COMM_SELF)
        store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], layout.backend, seed=1)
        make_runner(cfg, layout, store)
        formats.load_params(model_file, store)
    for i in layers:
        assert np.array_equal(store.persistent[f"h.{i}.moe.router.score_bias"], got[i])
    if len(layers) == 3:                                # deepseek_v3 has a Hugging Face form (test_hf_deepseek_model)
        init_from_starts_the_missing_depths_fresh(tmp_path, args, whole / "ckpt" / "step_00000004")
        return
    # no MixtralForCausalLM form: one line, exit 2, nothing written
    proc = run_cli("convert", str(whole / "ckpt" / "step_00000004"), str(tmp_path / "hf"), "--to", "hf")
    assert proc.returncode == 2 and "--router sigmoid (DeepSeekMoE's) has no MixtralForCausalLM form" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


def init_from_starts_the_missing_depths_fresh(tmp_path, args, source):
    """``train --init-from`` a checkpoint with MTP depth 1 and --mtp-depth 2
    (at --lr 0, so the step changes no parameter): depth 2 (its block h.4 and
    mtp.1.*) starts as a fresh run with the same --seed initialises it
    (``ParamStore``'s initialisation, from global indices only), said in
    one note line; every other tensor is the file's."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.files import formats
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve

    proc = run_cli("train", *args, "--init-from", str(source), "--mtp-depth", "2", "--steps", "1", "--lr", "0",
                   "--seed", "5", "--out", str(tmp_path / "deeper"))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "start" in line and "fresh" in line]
    assert said == [f"note: {source} holds 1 multi-token prediction depth: MTP depth 2 of --mtp-depth 2 starts "
                    "fresh (initialised as a fresh run with --seed 5 initialises it)"], said
    with formats.open_model(source) as old, formats.open_model(tmp_path / "deeper") as new:
        cfg, held, got = new.config, old.read_all(), new.read_all()
        held_buffers, got_buffers = old.read_buffers(), new.read_buffers()
    assert cfg.mtp_depth == 2 and set(held) < set(got)
    layout = build_layout(resolve("serial", cfg, 4, 1), make_backend("cpu", "float64"), MPI.COMM_SELF)
    fresh = ParamStore([layout.shard(d) for d in gpt_params(cfg)], layout.backend, seed=5)
    new_names = sorted(set(got) - set(held))
    assert new_names and all(n.startswith(("h.4.", "mtp.1.")) for n in new_names), new_names
    for name, value in got.items():
        assert np.array_equal(value, fresh.data[name] if name in new_names else held[name]), name
    assert sorted(got_buffers) == sorted(held_buffers) + ["h.4.moe.router.score_bias"]   # depth 2's router too


@pytest.mark.parametrize("args,message", [
    (["--n-groups", "3"], "--n-groups 3 must divide --n-experts (--n-routed-experts) 8"),
    (["--n-groups", "4", "--topk-groups", "5"], "--topk-groups 5 must be at most --n-groups 4"),
    (["--n-groups", "4", "--topk-groups", "1", "--top-k", "3"],
     "--top-k 3 is more than the 2 experts that --topk-groups 1 of --n-groups 4 hold"),
    (["--router", "softmax", "--n-groups", "2"], "--n-groups needs --router sigmoid"),
    (["--router-z-loss-coef", "0.1"], "--router-z-loss-coef applies to --router softmax only"),
    (["--bias-update-rate", "-1"], "--bias-update-rate must be a finite number in [0, 1]"),
    (["--arch", "deepseek_v3", "--ep", "3"], "--ep 3 must divide --n-experts 8"),
    (["--mtp-depth", "1"], "--mtp-depth applies to --arch deepseek_v3 only, not mixtral"),
])
def test_bad_deepseek_options_are_one_line(args, message, tmp_path):
    base = ["--arch", "mixtral", "--n-routed-experts", "8", "--router", "sigmoid"]
    if "--router" in args:
        base = base[:-2]
    if "--arch" in args:                                 # deepseek_v3 itself (its router is sigmoid by default)
        base = base[2:-2]
    proc = run_cli("train", "--steps", "1", "--out", str(tmp_path / "r"), *base, *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "r").exists()
