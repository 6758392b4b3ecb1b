"""--arch deepseek_v3 as a model (multi-head latent attention, the dense
SwiGLU MLP on every layer) in float64: the whole serial model's gradient
against central differences (q latent on and off, interleaved rotary on
and off, dropout on), its loss equal to the serial NumPy reference built
from the ops (tests/deepseek_reference.py, itself checked against
transformers), the configuration's round trip and parameter count, and
the command line's refusals."""

import dataclasses

import numpy as np
import pytest

import deepseek_reference as ref
from mpicube.core.config import ModelConfig
from mpicube.core.errors import ConfigError
from mpicube.core.rope_scaling import YarnScaling
from test_ops import check_whole_model_gradient

rng = np.random.default_rng(43)


def small_deepseek(**kw) -> ModelConfig:
    sizes = dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=4, n_embd=8, arch="deepseek_v3", ffn_hidden=6,
                 rope_theta=50.0, rms_eps=1e-5, q_lora_rank=5, kv_lora_rank=6, qk_rope_head_dim=4,
                 qk_nope_head_dim=2, v_head_dim=3)
    return ModelConfig(**{**sizes, **kw})


@pytest.mark.parametrize("q_rank, interleave", [(5, True), (0, False)])
def test_whole_deepseek_gradient(q_rank, interleave):
    """d loss / d every parameter of the serial DeepSeek-V3 (MLA, untied head, dropout on)."""
    cfg = small_deepseek(q_lora_rank=q_rank, rope_interleave=interleave)
    assert check_whole_model_gradient(cfg) == cfg.n_params()


def test_config_round_trips_and_counts():
    from mpicube.model.gpt import gpt_params, param_names

    cfg = small_deepseek()
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    decls = gpt_params(cfg)
    assert [d.name for d in decls] == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    yarn = small_deepseek(rope_scaling=YarnScaling(40.0, 64, mscale=1.0, mscale_all_dim=0.8, truncate=False))
    assert ModelConfig.from_dict(yarn.to_dict()).rope_scaling == yarn.rope_scaling     # stored (core.rope_scaling)
    for bad, words in (({"rope_type": "llama3"}, "rope_type must be 'yarn'"), ({"beta_slow": 64.0}, "beta_fast"),
                       ({"low_freq_factor": 1}, "rope_scaling.low_freq_factor is not a YaRN field")):
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_dict({**yarn.to_dict(), "rope_scaling": {**yarn.to_dict()["rope_scaling"], **bad}})
    kinds = {d.name[len("h.0.attn."):]: d.role for d in decls if d.name.startswith("h.0.attn.")}
    assert kinds == {"q_down.weight": "w_replicated", "q_norm.weight": "norm", "q_up.weight": "w_column",
                     "kv_down.weight": "w_replicated", "kv_norm.weight": "norm", "kv_up.weight": "w_column",
                     "c_proj.weight": "w_row"}



def test_the_placement_pictures_show_what_the_code_draws():
    """docs/deepseek.md's pictures of which rank holds which block of MLA's
    projections and the shared experts on each layout are what
    tools/mla_pictures.py draws from the layouts' ``shard`` now."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "tools/mla_pictures.py", "--check", "docs/deepseek.md"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

def shape_of(cfg: ModelConfig):
    """The reference's DeepseekV3Shape of ``cfg`` (every layer dense, MTP depths included)."""
    from mpicube.files.formats.hf_deepseek_config import DeepseekV3Shape

    return DeepseekV3Shape(
        vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, ffn_hidden=cfg.ffn,
        n_ctx=cfg.n_ctx, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
        n_routed_experts=0, moe_ffn_hidden=1, n_shared_experts=0, first_k_dense=cfg.n_blocks, top_k=1, n_groups=1,
        topk_groups=1, norm_topk=True, routed_scaling_factor=1.0, seq_aux_loss_coef=0.0, mtp_depth=cfg.mtp_depth,
        rope_theta=cfg.rope_theta, rope_interleave=cfg.rope_interleave, rms_eps=cfg.rms_eps,
        tie_embeddings=cfg.tied)


@pytest.mark.parametrize("q_rank, interleave", [(5, True), (0, False)])
def test_serial_loss_equals_reference(q_rank, interleave):
    """The model's loss equals the reference forward on the same tensors, to 1e-12 (blockwise attention)."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    cfg = small_deepseek(q_lora_rank=q_rank, rope_interleave=interleave, n_ctx=7)
    layout = build_layout(resolve("serial", cfg, 2, 1), make_backend("cpu", "float64"), MPI.COMM_SELF)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], make_backend("cpu", "float64"), seed=1)
    store.flat[:] += rng.normal(0, 0.3, store.flat.shape)
    tensors = {name: np.array(store.work[name]) for name in store.work}
    idx, tgt = rng.integers(0, cfg.vocab_size, (2, 7)), rng.integers(0, cfg.vocab_size, (2, 7))
    got = make_runner(cfg, layout, store).forward(idx, tgt, step=1)
    want = ref.forward(tensors, shape_of(cfg), idx, tgt)[0]
    assert abs(got - want) <= 1e-12 * abs(want), (got, want)


@pytest.mark.parametrize("args, words", [
    (["--q-lora-rank", "-1"], "--q-lora-rank must be an integer of at least 0"),
    (["--kv-lora-rank", "0"], "--kv-lora-rank must be an integer of at least 1"),
    (["--qk-rope-head-dim", "3"], "--qk-rope-head-dim must be even"),
    (["--v-head-dim", "40"], "--v-head-dim 40 must be at most"),
    (["--n-kv-head", "2"], "--n-kv-head does not apply to --arch deepseek_v3"),
    (["--layout", "3d"], "--kv-lora-rank 6 must be divisible by 4 on layout 3d"),
])
def test_bad_options_are_refused_by_name(args, words):
    from mpicube.core.config import family_fields
    from mpicube.parallel.planning import resolve

    opts = {"--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-rope-head-dim":
            "qk_rope_head_dim", "--v-head-dim": "v_head_dim", "--n-kv-head": "n_kv_head"}
    with pytest.raises(ConfigError, match=words):
        if args[0] == "--layout":
            resolve("3d", small_deepseek(), 8, 8)
        else:
            cfg = ModelConfig(n_head=4, n_embd=8, **family_fields(arch="deepseek_v3", **{opts[args[0]]: int(args[1])}))
            from mpicube.model.gpt import gpt_params
            gpt_params(cfg)


@pytest.mark.parametrize("kw, words", [
    (dict(arch="llama", mtp_depth=1), "--mtp-depth applies to --arch deepseek_v3 only, not llama"),
    (dict(arch="gpt2", mtp_loss_weight=0.1), "--mtp-loss-weight applies to --arch deepseek_v3 only, not gpt2"),
    (dict(arch="deepseek_v3", mtp_depth=-1), "--mtp-depth must be an integer of at least 0"),
    (dict(arch="deepseek_v3", mtp_loss_weight=0.1), "--mtp-loss-weight needs --mtp-depth"),
    (dict(arch="deepseek_v3", mtp_depth=1, mtp_loss_weight=float("nan")), "--mtp-loss-weight must be a finite"),
])
def test_mtp_options_are_refused_by_name(kw, words):
    from mpicube.core.config import family_fields

    with pytest.raises(ConfigError, match=words):
        family_fields(**kw)
    cfg = ModelConfig(n_head=4, n_embd=8, **family_fields(arch="deepseek_v3", mtp_depth=2, mtp_loss_weight=0.5))
    assert (cfg.mtp_depth, cfg.mtp_loss_weight) == (2, 0.5) and ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_other_families_refuse_the_latent_options():
    from mpicube.core.config import family_fields

    with pytest.raises(ConfigError, match="--kv-lora-rank applies to --arch deepseek_v3 only"):
        family_fields(arch="llama", kv_lora_rank=8)
    assert dataclasses.asdict(ModelConfig(arch="llama", n_head=2, n_embd=8)).keys() >= {"kv_lora_rank"}
    assert "kv_lora_rank" not in ModelConfig(arch="llama", n_head=2, n_embd=8).to_dict()


# DeepSeekMoE in the deepseek_v3 family (issue 43): block 0 dense, block 1 the mixture (sigmoid router,
# 4 experts in 2 groups, top 2 within 1 group, scaled 2.5, one shared expert, the sequence-wise loss)
MOE = dict(n_experts=4, top_k=2, router="sigmoid", n_groups=2, topk_groups=1, routed_scaling_factor=2.5,
           n_shared_experts=1, moe_ffn_hidden=3, first_k_dense=1, seq_aux_loss_coef=0.01, router_aux_loss_coef=0.0,
           router_z_loss_coef=0.0)


def test_whole_deepseek_moe_gradient():
    """d loss / d every parameter of the serial DeepSeek-V3 with DeepSeekMoE
    after a dense block, and two multi-token prediction depths (their
    blocks h.1, h.2 mixtures too; the loss main + (W/D) sum_k L_k): the
    depths' norms, projections and blocks, the chain from depth 1 to 2 and
    the shared embedding and head, one check (the suite's budget)."""
    cfg = small_deepseek(**MOE, n_layer=1, mtp_depth=2, mtp_loss_weight=0.5)
    assert check_whole_model_gradient(cfg) == cfg.n_params()


def test_moe_config_round_trips_and_counts():
    from mpicube.model.gpt import gpt_params, param_names

    cfg = small_deepseek(**MOE)
    stored = cfg.to_dict()
    assert ModelConfig.from_dict(stored).to_dict() == stored and stored["topk_groups"] == 1   # not n_groups'
    decls = gpt_params(cfg)
    assert [d.name for d in decls] == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    names = {d.name for d in decls}
    assert "h.0.mlp.c_fc.weight" in names and "h.1.mlp.c_fc.weight" not in names
    assert {"h.1.moe.router.weight", "h.1.moe.experts.3.c_proj.weight", "h.1.moe.shared.c_fc.weight"} <= names


def test_moe_options_take_the_sigmoid_router_by_default():
    from mpicube.core.config import family_fields

    got = family_fields(arch="deepseek_v3", n_experts=8, top_k=2, n_groups=4, topk_groups=2, n_shared_experts=1,
                        first_k_dense=1)
    assert (got["n_experts"], got["router"], got["n_groups"], got["topk_groups"], got["n_shared_experts"],
            got["first_k_dense"], got["router_aux_loss_coef"]) == (8, "sigmoid", 4, 2, 1, 1, 0.0)
    assert family_fields(arch="deepseek_v3", n_experts=4, router="softmax")["n_experts"] == 4
    assert "n_experts" not in family_fields(arch="deepseek_v3")                  # dense without --n-routed-experts
    with pytest.raises(ConfigError, match="--n-groups needs --n-experts"):
        family_fields(arch="deepseek_v3", n_groups=2)
    with pytest.raises(ConfigError, match="--router-aux-loss-coef applies to --router softmax only"):
        family_fields(arch="deepseek_v3", n_experts=4, router_aux_loss_coef=0.1)


# DeepSeek-V3's published shape (the report's Table / HF config.json): info prices it on these plans
V3_SHAPE = ["--arch", "deepseek_v3", "--n-layer", "61", "--n-embd", "7168", "--n-head", "128", "--q-lora-rank", "1536",
            "--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--qk-nope-head-dim", "128", "--v-head-dim", "128",
            "--ffn-hidden", "18432", "--n-routed-experts", "256", "--moe-ffn-hidden", "2048", "--n-shared-experts", "1",
            "--top-k", "8", "--n-groups", "8", "--topk-groups", "4", "--first-k-dense", "3", "--vocab-size", "129280",
            "--seq-len", "4096", "--dtype", "bfloat16", "--zero", "1", "--mtp-depth", "1"]
# tp 8 inside a node (MLA's 128 heads, 16 a rank), the experts over ep of the dp replicas, ZeRO-1 over dp
V3_PLANS = {64: ["-n", "64", "--layout", "1d", "--dp", "8", "--ep", "8", "--batch-size", "64"],
            512: ["-n", "512", "--layout", "1d", "--dp", "64", "--ep", "64", "--batch-size", "512"],
            2048: ["-n", "2048", "--layout", "1d", "--dp", "256", "--ep", "256", "--batch-size", "2048"]}


def test_published_shape_parameter_counts():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token, and
    14B of MTP module (with its copies of the embedding and the head); the
    first 3 blocks dense, the other 58 DeepSeekMoE, each counted as its kind."""
    from mpicube.analysis.param_counts import param_counts, params_line

    cfg = ModelConfig(vocab_size=129280, n_ctx=4096, n_layer=61, n_head=128, n_embd=7168, arch="deepseek_v3",
                      ffn_hidden=18432, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                      v_head_dim=128, n_experts=256, moe_ffn_hidden=2048, n_shared_experts=1, top_k=8, n_groups=8,
                      topk_groups=4, first_k_dense=3, router="sigmoid", mtp_depth=1)
    c = param_counts(cfg)
    assert abs(c.total - 671e9) < 0.5e9, c.total                       # 671,026,404,352
    assert abs(c.active - 37e9) < 0.6e9, c.active                      # 37,552,282,624 (embedding and head in)
    assert 13.4e9 < c.mtp_stored < 14.5e9, c.mtp_stored                 # the report's 14B (its copies included)
    attention = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert (c.n_dense, c.n_moe) == (3, 58)
    assert c.dense_block == 2 * 7168 + attention + 3 * 7168 * 18432
    assert c.moe_block == 2 * 7168 + attention + 257 * 3 * 7168 * 2048 + 7168 * 256
    assert c.total == c.embed + c.final + 3 * c.dense_block + 58 * c.moe_block
    line = params_line(cfg, c)
    assert "3 dense layers x " in line and "58 MoE layers x " in line and "multi-token prediction: 1 depth" in line


def test_info_prices_the_published_shape(mpicube):
    """info --arch deepseek_v3 at the published shape prints the parameters
    per block kind, the traffic per axis (tp, dp, ep), the memory and the
    FLOPs per rank (64 ranks, serially, no mpiexec); the same figures at
    512 and 2048 ranks from the cost model's functions (the whole report
    there prices every layout and option again: tens of seconds each)."""
    from mpicube.analysis.costflops import step_flops
    from mpicube.analysis.costmemory import step_memory_bytes
    from mpicube.analysis.costmodel import Problem, step_traffic

    out = mpicube.run("info", *V3_SHAPE, *V3_PLANS[64])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "parameters: 671,026,404,352 (" in text and "active per token 37,552,282,624" in text
    assert "3 dense layers x 583,483,392, 58 MoE layers x 11,507,286,016" in text
    assert "multi-token prediction: 1 depth, 11,610," in text
    for want in ("communication per rank per step", "memory per rank", "GEMM and attention FLOPs per rank",
                 "all-to-all per rank per step (axis ep"):
        assert want in text, want
    cfg = ModelConfig(vocab_size=129280, n_ctx=4096, n_layer=61, n_head=128, n_embd=7168, arch="deepseek_v3",
                      ffn_hidden=18432, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                      v_head_dim=128, n_experts=256, moe_ffn_hidden=2048, n_shared_experts=1, top_k=8, n_groups=8,
                      topk_groups=4, first_k_dense=3, router="sigmoid")
    for world, dp in ((512, 64), (2048, 256)):
        p = Problem(cfg, "1d", 8, dp, 1, world // 8, 4096, "bfloat16", zero=1, ep=dp)
        t, m = step_traffic(p), step_memory_bytes(p)
        assert all(t.bytes[axis] > 0 for axis in ("tp", "dp", "ep")) and m.total() > 0 and step_flops(p) > 0


# multi-token prediction (issue 43): D depths after the main model, each a block named h.{L + k - 1}
def test_mtp_loss_equals_reference_and_logs_each_depth():
    """The model's loss, main loss and each depth's equal the reference's
    (depth k over the B (T - k) positions with a target), to 1e-12."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    cfg = small_deepseek(n_ctx=7, mtp_depth=2, mtp_loss_weight=0.4)
    layout = build_layout(resolve("serial", cfg, 2, 1), make_backend("cpu", "float64"), MPI.COMM_SELF)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], make_backend("cpu", "float64"), seed=1)
    store.flat[:] += rng.normal(0, 0.3, store.flat.shape)
    tensors = {name: np.array(store.work[name]) for name in store.work}
    idx, tgt = rng.integers(0, cfg.vocab_size, (2, 7)), rng.integers(0, cfg.vocab_size, (2, 7))
    runner = make_runner(cfg, layout, store)
    got = runner.forward(idx, tgt, step=1)
    want, main, depths = ref.forward(tensors, shape_of(cfg), idx, tgt, mtp_depth=2, mtp_weight=0.4)
    assert abs(got - want) <= 1e-12 * abs(want), (got, want)
    log = runner.mtp_log.take()
    assert set(log) == {"main_loss", "mtp_loss_1", "mtp_loss_2"}
    np.testing.assert_allclose([log["main_loss"], log["mtp_loss_1"], log["mtp_loss_2"]], [main] + depths, rtol=1e-12)
    assert abs(want - main - 0.2 * sum(depths)) <= 1e-12 * want
