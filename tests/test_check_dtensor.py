"""tools/check_dtensor.py: a DTensor tensor-parallel GPT-2 on two gloo
ranks, recorded shard by shard by mpicube.check.torch, agrees with the
same model on one process, and a planted gradient scale is named.

Needs a Python with torch (this one, or MPICUBE_TORCH_PYTHON); skipped
otherwise. The reference is a small synthetic trace (tests/test_check.py),
so no mpicube run is needed: both torch runs start from its parameters
and batches and must agree with each other.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from test_check import write_good

from mpicube.check.compare import compare_traces

REPO = Path(__file__).resolve().parents[1]


def torch_python():
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    return os.environ.get("MPICUBE_TORCH_PYTHON")


def launch(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


# planted bug -> the first divergence it must be named at (tools/check_dtensor.py's catalogue)
NAMED = {"grad-scale": "step_1/grad/h.1.mlp.c_fc.weight", "norm-replicas": "step_1/grad_norm",
         "qkv-split": "step_1/act/h.0.attn", "dropout-rank": "step_1/dropout/h.0.attn",
         "sp-grad": "step_1/grad/h.1.ln_2.weight"}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """(python, reference, folder): a Python with torch, a synthetic
    reference and the single-process torch trace of it (one.h5) that both
    tests compare against, made once; skipped without torch."""
    python = torch_python()
    if python is None:
        pytest.skip("torch is not installed (optional: pip install torch, or set MPICUBE_TORCH_PYTHON)")
    folder = tmp_path_factory.mktemp("torch")
    ref = write_good(folder / "ref.h5")
    launch([python, str(REPO / "tools" / "torch_trace.py"), str(ref), "--out", "one.h5"], folder)
    return python, ref, folder


@pytest.mark.timeout(300)
def test_dtensor_shards_agree_with_one_process_and_every_planted_bug_is_named(one):
    """One launch: tensor parallelism alone, and with sequence parallelism
    the clean run and one run per planted bug. The clean traces (attention
    and MLP split by heads and columns, masks recorded per rank, under --sp
    each rank's rows of the blocks' activations) agree with the single
    process to 1e-10; each bug is named at its tensor, the loss still
    agreeing where the bug is in backward, the ranks named where replicas
    part."""
    python, ref, tmp_path = one
    launch([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "tools" / "check_dtensor.py"), "--ref", str(ref), "--out", "sp.h5", "--sp", "--plant", "all"],
           tmp_path)
    with h5py.File(tmp_path / "sp.h5", "r") as f:
        assert f["step_1/act/h.1.ln_2/rank1/data"].shape == (2, 2, 8)                   # rank 1's rows
        assert list(f["step_1/act/h.1.ln_2/rank1/index_1"][()]) == [2, 3]
    with h5py.File(tmp_path / "sp-tp.h5", "r") as f:
        w = f["step_1/grad/h.0.mlp.c_fc.weight"]
        assert set(w) == {"rank0", "rank1"} and w["rank0/data"].shape == (8, 16)      # column halves
        assert f["step_1/grad/h.0.attn.c_attn.weight/rank1/data"].shape == (8, 12)     # heads 1: [q k v] of head 1
        assert f["step_1/dropout/h.0.attn/rank1/data"].shape == (2, 1, 4, 4)           # the head rank 1 applied
        assert set(f["step_1/grad/h.0.ln_1.weight"]) == {"rank0", "rank1"}             # replicas
        assert json.loads(f.attrs["mesh"])["sizes"] == [2]                             # placements (issue 47)
        assert w["rank1"].attrs["placement"] == "S(1)" and list(w["rank1"].attrs["coords"]) == [1]
        assert f["step_1/grad/h.0.ln_1.weight/rank1"].attrs["placement"] == "R"
    for clean in ("sp-tp.h5", "sp.h5"):
        result = compare_traces(tmp_path / "one.h5", tmp_path / clean)
        assert result.first_divergence is None and result.max_rel < 1e-10, clean
    for bug, first in NAMED.items():
        result = compare_traces(tmp_path / "one.h5", tmp_path / f"sp-{bug}.h5")
        assert result.first_divergence == first, bug
        rows = {r.name: r for r in result.rows}
        assert bug != "sp-grad" or "replicas part: ranks 0 and 1" in rows[first].note
        assert bug != "sp-grad" or "a pending sum over" in rows[first].note, rows[first].note
        if "grad" in first:
            assert rows["step_1/loss"].ok and rows["step_1/act/h.1"].ok, bug                 # the loss agrees


@pytest.mark.timeout(300)
def test_fsdp2_shards_and_rows_agree_with_one_process_and_its_planted_bugs_are_named(one):
    """tools/check_fsdp2.py in one launch: FSDP2 on two gloo ranks (every
    parameter and gradient a dimension-0 shard, each rank its own sequences)
    agrees with one process to 1e-10; a loss summed instead of averaged
    over the ranks is named at the first gradient while the loss agrees,
    masks not drawn per rank at the embedding's mask."""
    python, ref, tmp_path = one
    launch([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "tools" / "check_fsdp2.py"), "--ref", str(ref), "--out", "fsdp.h5", "--plant", "all"], tmp_path)
    with h5py.File(tmp_path / "fsdp.h5", "r") as f:
        assert f["step_1/grad/wte/rank1/data"].shape == (8, 8)                         # rows 8..15 of (16, 8)
        assert list(f["step_1/act/h.0.attn/rank1/index_0"][()]) == [1]                  # rank 1's sequence
    result = compare_traces(tmp_path / "one.h5", tmp_path / "fsdp.h5")
    assert result.first_divergence is None and result.max_rel < 1e-10
    result = compare_traces(tmp_path / "one.h5", tmp_path / "fsdp-dp-scale.h5")
    rows = {r.name: r for r in result.rows}
    assert result.first_divergence == "step_1/grad/ln_f.weight" and rows["step_1/loss"].ok
    assert compare_traces(tmp_path / "one.h5", tmp_path / "fsdp-dropout-rank.h5").first_divergence == "step_1/dropout/emb"
