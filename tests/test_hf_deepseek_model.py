"""--arch deepseek_v3's model on Hugging Face DeepseekV3 directories (every
layer dense, as the model builds so far): a directory transformers saved
is read through ``formats.open_model`` and the mpicube model's float64
loss equals transformers' (float64 internals, tests/hf_float64.py) to
1e-12; ``convert`` to a mpicube checkpoint and back to a Hugging Face
directory gives one transformers loads, with the same loss; ``eval`` and
``train --init-from`` take the directory on the command line; a file
with mixture-of-experts layers is refused by its field."""

import json
import subprocess
import sys

import numpy as np
import pytest

from test_hf_deepseek import B, T, V, YARN, hf, hf_config, hf_loss, randomise, with_rope  # noqa: F401 (fixture)


def dense_config(transformers, **over):
    """hf_config with every layer dense (first_k_dense_replace = num_hidden_layers)."""
    return hf_config(transformers, first_k_dense_replace=3, **over)


def mpicube_loss(model_file, ids, targets, layout="serial"):
    """The serial float64 model's loss on ``model_file``'s tensors."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    cfg = model_file.config
    tensors = model_file.read_all()
    backend = make_backend("cpu", "float64")
    lay = build_layout(resolve(layout, cfg, ids.shape[0], 1, seq_len=ids.shape[1]), backend, MPI.COMM_SELF)
    store = ParamStore([lay.shard(d) for d in gpt_params(cfg)], backend, seed=1)
    for name, t in tensors.items():
        store.work[name][...] = t
    return make_runner(cfg, lay, store).forward(ids, targets, step=1)


def saved_model(torch, transformers, path, **over):
    model = randomise(torch, transformers.DeepseekV3ForCausalLM(dense_config(transformers, **over)).double().eval())
    model.save_pretrained(str(path))
    return model


def tokens(seed=0):
    t = np.random.default_rng(seed).integers(0, V, size=(B, T + 1))
    return t[:, :-1], t[:, 1:]


@pytest.mark.parametrize("q_rank,interleave,rope", [(5, True, None), (None, False, None), (5, True, YARN)],
                         ids=["q-latent", "q-proj-half-split", "yarn"])
def test_directory_loss_equals_transformers(hf, tmp_path, q_rank, interleave, rope):
    from mpicube.files import formats

    torch, transformers, _ = hf
    model = saved_model(torch, transformers, tmp_path / "ds", q_lora_rank=q_rank, rope_interleave=interleave,
                        **with_rope(rope))
    ids, targets = tokens()
    with formats.open_model(tmp_path / "ds") as f:
        assert f.config.arch == "deepseek_v3" and "DeepseekV3" in f.describe()
        got = mpicube_loss(f, ids, targets)
    assert got == pytest.approx(hf_loss(torch, model, ids, targets), rel=1e-12)


def test_convert_both_ways_loads_in_transformers(hf, tmp_path):
    from mpicube.files import formats
    from mpicube.files.formats.convert import convert

    torch, transformers, _ = hf
    saved_model(torch, transformers, tmp_path / "ds")
    convert(tmp_path / "ds", tmp_path / "run", "mpicube")
    convert(tmp_path / "run", tmp_path / "back", "hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v3"
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
    back = back.double().eval()
    ids, targets = tokens(1)
    with formats.open_model(tmp_path / "run") as f:
        got = mpicube_loss(f, ids, targets)
    assert got == pytest.approx(hf_loss(torch, back, ids, targets), rel=1e-12)


def test_eval_and_init_from_take_the_directory(hf, tmp_path):
    torch, transformers, _ = hf
    saved_model(torch, transformers, tmp_path / "ds", vocab_size=256)    # the built-in corpus's bytes
    run = [sys.executable, "-m", "mpicube"]
    out = subprocess.run(run + ["eval", str(tmp_path / "ds"), "--batches", "1", "--seq-len", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(run + ["train", "--init-from", str(tmp_path / "ds"), "--steps", "2", "--seq-len", "8",
                                "--out", str(tmp_path / "run"), "--log-every", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["arch"] == "deepseek_v3"


def test_moe_layers_are_refused_by_field(hf, tmp_path):
    from mpicube.files import formats
    from mpicube.files.formats.base import FormatError

    torch, transformers, _ = hf
    transformers.DeepseekV3ForCausalLM(hf_config(transformers)).save_pretrained(str(tmp_path / "moe"))
    with pytest.raises(FormatError, match="first_k_dense_replace = 1 is below num_hidden_layers 3"):
        formats.open_model(tmp_path / "moe")


def test_greedy_tokens_through_the_latent_cache_equal_transformers(hf, tmp_path):
    """``generate`` on the directory (serial, 1-D tp 2, 2-D tp 4, 3-D tp 8: the
    latent cache holding this rank's block of the normed kv latent and the
    rotated k_pe, moved to the heads' rows on 3-D) gives transformers'
    float64 greedy tokens."""
    from mpirun import mpiexec

    torch, transformers, _ = hf
    model = saved_model(torch, transformers, tmp_path / "ds", q_lora_rank=8, kv_lora_rank=8)   # split 4 ways on 3-D
    prompt, n_new = [5, 17, 3, 40], 6
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_new):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    want = ids[0, len(prompt):].tolist()
    args = ["-m", "mpicube", "generate", tmp_path / "ds", "--prompt-tokens", ",".join(map(str, prompt)),
            "--max-new-tokens", n_new, "--temperature", 0, "--json"]
    for ranks, layout in ((1, "serial"), (2, "1d"), (4, "2d"), (8, "3d")):
        out = mpiexec(ranks, args + ["--layout", layout], timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1])["tokens"] == want, layout
