"""The command line end to end: real mpiexec, real files."""

import json

import numpy as np
import pytest
from conftest import PYTHON, TINY, last_json, paired, read_metrics, sample_text_files

from mpicube.files import checkpoint, data
from mpicube.core.config import ModelConfig

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "comm_elems", "comm_msgs"}


def test_prepare_train_eval_inspect(mpicube, tmp_path):
    texts = sample_text_files()
    r = mpicube.run("prepare", *texts, "--out", "corpus.bin", "--val-fraction", "0.1")
    assert r.returncode == 0, r
    train_shard, val_shard = tmp_path / "corpus.bin", tmp_path / "corpus_val.bin"
    n_train, n_val = len(data.read_shard(train_shard)), len(data.read_shard(val_shard))
    assert n_train + n_val == sum(p.stat().st_size + 1 for p in texts)       # bytes plus one separator each
    assert f"{n_train:,} tokens" in r.stdout and f"{n_val:,} tokens" in r.stdout

    r = mpicube.run("train", *TINY, "--steps", "6", "--eval-every", "3", "--data", "corpus.bin",
                    "--out", "run", "--dtype", "float64")
    assert r.returncode == 0, r
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == {"vocab_size": 256, "n_ctx": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}
    assert config["train"]["steps"] == 6 and config["train"]["eval_every"] == 3
    assert config["layout"]["layout"] == "serial" and config["world_size"] == 1
    assert config["data"]["val"].endswith("corpus_val.bin")
    assert "mpicube_version" in config

    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    for s in steps:
        assert set(s) >= STEP_KEYS
        assert np.isfinite(s["loss"]) and s["grad_norm"] > 0 and s["tokens_per_s"] > 0
    assert steps[0]["loss"] == pytest.approx(np.log(256), abs=0.2)        # an untrained model guesses uniformly
    assert [e["step"] for e in evals] == [3, 6]

    assert checkpoint.latest(run) == run / "ckpt" / "step_00000006"
    with checkpoint.open_checkpoint(run) as ck:
        assert ck.step == 6 and ck.attrs["adam_t"] == 6
        assert "model/wte" in ck.names() and "optimizer/v/h.0.mlp.c_fc.weight" in ck.names()

    # `eval` of the final checkpoint on the training run's validation windows
    # reproduces the validation loss the run logged at that step
    r1 = mpicube.run("eval", "run", "--data", "corpus_val.bin", "--batch-size", "4", "--seq-len", "16",
                     "--batches", "8", "--dtype", "float64")
    r2 = mpicube.run("eval", "run", "--data", "corpus_val.bin", "--batch-size", "4", "--seq-len", "16",
                     "--batches", "8", "--dtype", "float64")
    assert r1.returncode == 0 and r2.returncode == 0, (r1, r2)
    out1, out2 = last_json(r1.stdout), last_json(r2.stdout)
    assert out1["loss"] == out2["loss"]
    assert out1["loss"] == pytest.approx(evals[-1]["val_loss"], rel=1e-12)
    assert out1["step"] == 6 and out1["tokens"] == 8 * 4 * 16

    r = mpicube.run("inspect", "run")
    assert r.returncode == 0 and "result: OK" in r.stdout, r
    shard = next((run / "ckpt" / "step_00000006" / "shards").iterdir())
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    r = mpicube.run("inspect", "run")
    assert r.returncode == 1 and "FAILED" in r.stdout, r


def test_eval_reproduces_training_loss(mpicube, tmp_path):
    """With --lr 0 the parameters never change; a shard of exactly B windows
    makes step 1's batch a permutation of evaluation batch 0, so `eval` of the
    saved checkpoint must give step 1's training loss (here on 2 ranks)."""
    B, T = 4, 16
    tokens = data.encode_bytes(sample_text_files()[0].read_bytes())[: B * T + 1]
    data.write_shard(tmp_path / "exact.bin", tokens)
    r = mpicube.run("train", *TINY, "--steps", "1", "--lr", "0", "--warmup", "0", "--data", "exact.bin",
                    "--out", "run", "--dtype", "float64")
    assert r.returncode == 0, r
    steps, _ = read_metrics(tmp_path / "run")
    r = mpicube.run("eval", "run", "--data", "exact.bin", "--batch-size", B, "--seq-len", T, "--batches", "1",
                    "--layout", "serial", "--dp", "2", "--dtype", "float64", n=2)
    assert r.returncode == 0, r
    assert len([line for line in r.stdout.splitlines() if line.startswith("{")]) == 1   # rank 0 only
    result = last_json(r.stdout)
    assert result["tokens"] == B * T
    assert abs(result["loss"] - steps[0]["loss"]) < 1e-10


def test_config_file_and_overrides(mpicube, tmp_path):
    (tmp_path / "run.toml").write_text(
        'layout = "serial"\nn-layer = 1\nn_head = 2\nn-embd = 16\nseq_len = 16\nbatch-size = 4\n'
        'steps = 2\nlr = 0.001\ndtype = "float64"\nlog-every = 1\nout = "from-file"\n')
    r = mpicube.run("train", "--config", "run.toml", "--steps", "3", "--out", "from-cli")
    assert r.returncode == 0, r
    assert not (tmp_path / "from-file").exists()
    train = json.loads((tmp_path / "from-cli" / "config.json").read_text())["train"]
    assert train["steps"] == 3                        # the command line wins
    assert train["lr"] == 0.001 and train["n_embd"] == 16 and train["log_every"] == 1 and train["dtype"] == "float64"
    assert len(read_metrics(tmp_path / "from-cli")[0]) == 3
    assert len([line for line in r.stdout.splitlines() if line.startswith("step ")]) == 3   # --log-every 1

    (tmp_path / "bad.toml").write_text("n_layers = 2\n")
    r = mpicube.run("train", "--config", "bad.toml")
    assert r.returncode == 2 and len(r.error_lines()) == 1 and "n_layers" in r.error_lines()[0], r


def hostile_value_cases(tmp_path):
    """(name, argv, expected error) for option values that used to be
    converted loosely or end in a traceback (issue 24, defect 8), and sizes
    no rank can hold (defect 2)."""
    import os

    tomls = {"float": "n-embd = 32.7\n", "bool": "steps = true\n", "twice": "n-embd = 32\nn_embd = 16\n",
             "list": "n-embd = [16, 32]\n", "flag": 'tf32 = "yes"\n'}
    for name, text in tomls.items():
        (tmp_path / f"{name}.toml").write_text(text)
    os.mkfifo(tmp_path / "fifo.toml")
    train = ["train", "--steps", "1", "--out", tmp_path / "run"]
    config = [
        ("toml float", ["--config", tmp_path / "float.toml"], r"n-embd = 32.7: expected an integer"),
        ("toml bool", ["--config", tmp_path / "bool.toml"], r"steps = true: expected an integer"),
        ("toml twice", ["--config", tmp_path / "twice.toml"], r"'n-embd' and 'n_embd' are the same option"),
        ("toml list", ["--config", tmp_path / "list.toml"], r"n-embd = \[16, 32\]: a list, and n-embd takes one"),
        ("toml flag", ["--config", tmp_path / "flag.toml"], r"tf32 = 'yes': expected true or false"),
        ("toml fifo", ["--config", tmp_path / "fifo.toml"], r"fifo.toml: not a regular file"),
        ("seed", ["--seed", "-1"], r"-1 is not in the range 0<=x<=18446744073709551615"),
        ("layers", ["--n-layer", "1000000"], r"n_layer 1,000,000.* needs at least 1.8 TiB of memory per rank"),
        ("width", ["--n-embd", "100000", "--n-head", "10"], r"480,037,400,000 parameters.* needs at least"),
        ("context", ["--seq-len", "1000000"], r"one layer's activations, but"),
        ("vocabulary", ["--vocab-size", "2000000000"], r"vocab 2,000,000,000.* needs at least"),
    ]
    cases = [(name, train + args, expect) for name, args, expect in config]
    cases.append(("llama kv heads", ["train", "--steps", "1", "--out", tmp_path / "llama-run", "--arch", "llama",
                                     "--n-head", "4", "--n-embd", "16", "--n-kv-head", "3"],
                  r"--n-kv-head 3 must divide --n-head 4"))
    cases += [("generate seed", ["generate", "x", "--seed", "-1"], r"-1 is not in the range"),
              ("bench seed", ["bench", "--seed", "-1"], r"-1 is not in the range"),
              ("bench layers", ["bench", "--n-layer", "1000000", "--batch-size", "4"],
               r"n_layer 1,000,000.* needs at least"),
              ("bench llama kv heads", ["bench", "--arch", "llama", "--n-head", "4", "--n-embd", "16",
                                        "--n-kv-head", "3"], r"^error: --n-kv-head 3 must divide --n-head 4")]
    return cases


def test_hostile_values_and_sizes_are_one_line_each(tmp_path, corpus_cache):
    """Each in one process through the real entry point (tests/cli_cases.py):
    exit 2, one error line, no traceback, no MemoryError after minutes."""
    import re
    import subprocess
    from pathlib import Path

    from mpirun import job_env

    cases = hostile_value_cases(tmp_path)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for _, argv, _ in cases]))
    proc = subprocess.run([PYTHON, str(Path(__file__).with_name("cli_cases.py")), str(spec)], cwd=tmp_path,
                          env=job_env({"MPICUBE_CACHE": str(corpus_cache)}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (name, _, expect), res in paired(cases, json.loads(proc.stdout.strip().splitlines()[-1])):
        lines = res["out"] + res["err"]
        errors = [line for line in lines if line.startswith("error:")]
        assert res["status"] == 2 and len(errors) == 1, (name, res)
        assert re.search(expect, errors[0]), (name, errors[0])
        assert not any("Traceback" in line for line in lines), (name, res)
        if name == "bench llama kv heads":               # refused before any layout's note
            assert lines == errors, (name, res)
    assert not (tmp_path / "llama-run").exists()         # refused before its run directory was made
    assert not (tmp_path / "run").exists()               # so were the models too large for this machine


@pytest.mark.parametrize("model", [(4, 12, 144, 64), (1, 2, 16, 16), (3, 4, 64, 128)])
def test_info_parameter_count(mpicube, model):
    n_layer, n_head, n_embd, seq_len = model
    r = mpicube.run("info", "--n-layer", n_layer, "--n-head", n_head, "--n-embd", n_embd, "--seq-len", seq_len)
    assert r.returncode == 0, r
    expected = ModelConfig(256, seq_len, n_layer, n_head, n_embd).n_params()
    line = next(line for line in r.stdout.splitlines() if line.startswith("parameters:"))
    assert int(line.split()[1].replace(",", "")) == expected


def corrupt_shard(path):
    data.write_shard(path, np.arange(1000) % 256)
    raw = bytearray(path.read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")          # wrong magic number
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case, args, needle", [
    ("heads", ["--n-head", "5"], "divisible by n_head 5"),
    ("missing data", ["--data", "nowhere.bin"], "nowhere.bin: token shard not found"),
    ("corrupt data", ["--data", "corrupt.bin"], "wrong magic number"),
    ("usage", ["--layout", "4d"], "'4d' is not one of"),
    ("lr", ["--lr", "nan"], "--lr must be a finite number"),
])
def test_bad_input_is_one_error_line(mpicube, tmp_path, case, args, needle):
    corrupt_shard(tmp_path / "corrupt.bin")
    r = mpicube.run("train", *TINY, "--steps", "2", "--out", "run", *args)
    assert r.returncode == 2, r
    assert len(r.error_lines()) == 1 and needle in r.error_lines()[0], r
    assert "Traceback" not in r.stdout + r.stderr, r
    assert not (tmp_path / "run" / "ckpt").exists()


def test_dp_not_dividing_world_size(mpicube):
    r = mpicube.run("train", *TINY, "--dp", "3", "--steps", "2", n=2)
    assert r.returncode == 2, r
    assert r.error_lines() == ["error: --dp 3 must divide the world size 2; choose one of [1, 2]"], r
    assert "Traceback" not in r.stdout + r.stderr


def test_user_error_on_one_rank_ends_the_job(mpicube, tmp_path, tiny_shard):
    """The data file is missing on rank 1's node (each rank runs in its own
    directory, which stands for a node's local disk): one error naming rank
    1 and the file, exit status 2, before any rank writes anything. (Exit
    status 2 also says no rank was left waiting: MPIEXEC_TIMEOUT's kill
    would end the job otherwise.)"""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    (node0 / "only-rank-0-has-it.bin").write_bytes(tiny_shard.read_bytes())
    args = ["train", *TINY, "--dp", "2", "--steps", "50", "--data", "only-rank-0-has-it.bin", "--out", "run"]
    cmd = [mpicube.mpiexec]
    for i, node in enumerate((node0, node1)):
        cmd += ([":"] if i else []) + ["-n", "1", "-wdir", str(node), PYTHON, "-m", "mpicube", *args]
    r = mpicube.run(cmd=cmd)
    assert r.returncode == 2, r
    lines = r.error_lines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: only-rank-0-has-it.bin: token shard not found"), r
    assert "Traceback" not in r.stdout + r.stderr
    assert not (node0 / "run").exists()                    # decided before the run directory


def test_unexpected_exception_on_one_rank_aborts_the_job(mpicube, tmp_path):
    cmd = mpicube.mpmd((1, ["train", *TINY, "--dp", "2", "--steps", "100000", "--out", "run"], None),
                       (1, ["train", *TINY, "--dp", "2", "--steps", "100000", "--out", "run"],
                        {"MPICUBE_TEST_CRASH_RANK": "1"}))
    r = mpicube.run(cmd=cmd)
    assert r.returncode not in (0, 2), r
    assert "[rank 1] Traceback" in r.stderr and "[rank 1] RuntimeError: MPICUBE_TEST_CRASH_RANK" in r.stderr, r
    assert "[rank 0] Traceback" not in r.stderr
    assert len(read_metrics(tmp_path / "run")[0]) < 10


def test_bench_reports_and_matches_the_cost_model(mpicube):
    """`mpicube bench --json` on 4 ranks, 1-D and 2-D in one job: the keys
    the issue asks for, positive times and rates, which kernels ran, and the
    measured communication equal to the model's prediction."""
    from mpicube.device.blas_kernel import cpu_flags, cpu_kernels

    level = cpu_kernels(cpu_flags())[0] or 0
    pin = {"OPENBLAS_CORETYPE": "Haswell"} if level >= 4 else {}      # Haswell's kernels need AVX2
    r = mpicube.run("bench", "--layout", "1d", "--layout", "2d", "--n-layer", "1", "--n-embd", "24",
                    "--n-head", "4", "--seq-len", "8", "--batch-size", "4", "--warmup-steps", "1",
                    "--steps", "2", "--json", n=4, env={"OMP_NUM_THREADS": "1", **pin})
    assert r.returncode == 0, r
    out = last_json(r.stdout)
    # which BLAS kernels ran (threadpoolctl's architecture), and one line when a pin holds them below the CPU
    assert f"BLAS: {out['blas']}" in r.stdout and out["blas"].startswith(("openblas", "mkl", "blis")), out["blas"]
    if pin:
        assert "openblas" not in out["blas"] or "(Haswell kernels" in out["blas"], out["blas"]
        warned = [line for line in r.stdout.splitlines() if line.startswith("warning: OPENBLAS_CORETYPE=Haswell")]
        assert len(warned) == (1 if level > 4 else 0) and out["blas_pin_warning"] == (warned or [None])[0], r
    assert out["step_time_s"] > 0 and out["tokens_per_s"] > 0 and out["gemm_fraction"] > 0, out
    assert out["threads"]["threads"] == 1 and out["threads"]["source"] == "OMP_NUM_THREADS", out["threads"]
    assert out["threads"]["pools"]["numba"] == 1 and "threads: 1 thread(s) per rank" in r.stdout
    assert [res["layout"] for res in out["results"]] == ["1d", "2d"]
    for res in out["results"]:
        assert res["comm"]["exact"], res["comm"]
        assert res["comm"]["measured_elems"] > 0
        assert res["kernels"] == "numba fused, 1 thread(s) per rank", res["kernels"]   # OMP_NUM_THREADS=1
        assert set(res["split"]) == {"forward_s", "backward_s", "sync_s", "optimizer_s", "comm_s"}
    assert "kernels:" in r.stdout
