"""Hostile model files (issue 24, defects 2 and 8): every case of
tests/hostile_models.py, and checkpoints whose attributes have the wrong
type, through every command that reads a model, each one line ``error:``
and exit status 2 within 10 s, under an address-space limit of 1 GiB,
leaving no converted model or run directory behind.
Before, an llm.c header claiming 2**31 - 1 layers took 92 s and 5.7 GB
before a MemoryError traceback.

The many cases run through the real entry point in one process under the
limit (tests/hostile_models.py as a script, as tests/cli_cases.py); the
headline ones also run as real ``mpiexec`` jobs under it, on one rank and
two. Property-based tests (hypothesis) feed the llm.c header parser and
the Hugging Face config parser arbitrary input: each gives a valid
configuration or its own one-line error, never another exception.
"""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import PYTHON, MpiCube, paired
from gpt2_files import hf_config, random_gpt2, write_llmc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpirun import job_env

import hostile_models
from hostile_models import TINY, entry_points, make_cases

from mpicube.core.config import ModelConfig
from mpicube.files import checkpoint
from mpicube.files.formats import FormatError, hf, llmc
from mpicube.files.formats.convert import convert

HERE = Path(__file__).resolve().parent
LIMIT = 1 << 30                 # RLIMIT_AS of every command here: 1 GiB (a normal small run maps about 480 MiB)
SECONDS = 10                    # each refusal, at most


def limit_address_space():
    """preexec_fn of every child: RLIMIT_AS = LIMIT, inherited by mpiexec's ranks."""
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def run_limited(tmp_path, argvs, cache) -> dict:
    """Run mpicube commands in one process under LIMIT; its JSON report."""
    spec = tmp_path / "hostile-cases.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for argv in argvs]))
    env = job_env({"MPICUBE_CACHE": str(cache)}, timeout=120)
    proc = subprocess.run([PYTHON, str(HERE / "hostile_models.py"), str(spec)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180, preexec_fn=limit_address_space)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_one_line(name, result, expect):
    lines = result["out"] + result["err"]
    errors = [line for line in lines if line.startswith("error:")]
    assert result["status"] == 2 and len(errors) == 1, (name, result)
    assert re.search(expect, errors[0]), (name, errors[0])
    assert not any("Traceback" in line for line in lines), (name, result)
    assert result["seconds"] < SECONDS, (name, result["seconds"])


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return root, make_cases(root)


def test_every_hostile_model_is_one_line_through_every_command(hostile, tmp_path, corpus_cache):
    root, cases = hostile
    (tmp_path / "out").mkdir()
    good = hostile_models.Case("good", root / "good.bin", "")
    argvs, names = [], []
    for case in [good] + cases:
        for command, argv in entry_points(case, tmp_path / "out").items():
            argvs.append(argv)
            names.append((case, command))
    report = run_limited(tmp_path, argvs, corpus_cache)
    results = report["results"]
    for (case, command), result in paired(names, results):
        if not case.expect:         # a normal small run (GPT-2, Llama) fits under the limit, through every command
            assert result["status"] == 0, (case.name, command, result)
        else:
            assert_one_line(f"{case.name} via {command}", result, case.expect)
            written = [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(case.name + "-")]
            assert not written, (case.name, written)     # refused before a run directory or a conversion exists
    assert 0 < report["vm_peak"] < LIMIT
    print(f"{len(results)} commands, {sum(r['seconds'] for r in results):.1f} s, "
          f"peak address space {report['vm_peak'] / 2 ** 20:.0f} MiB")


def test_real_jobs_under_the_limit(hostile, tmp_path, corpus_cache):
    """The headline cases as real jobs, ``mpiexec -n N python -m mpicube``,
    every rank under the limit: an llm.c header of 2**31 - 1 layers through
    each command on one rank; a Hugging Face config of as many on two. A
    job's seconds include starting Python, MPI and numba (seconds on a
    loaded machine): each refusal may take 10 s more than a normal tiny
    ``eval`` job, run first, which starts the same way and then works."""
    root, cases = hostile
    by_name = {c.name: c for c in cases}
    (tmp_path / "out").mkdir()
    cube = MpiCube(tmp_path, corpus_cache)

    def job(n, argv):
        t0 = time.monotonic()
        proc = subprocess.run(cube.command(*argv, n=n), cwd=tmp_path, env=cube.env, capture_output=True, text=True,
                              timeout=90, preexec_fn=limit_address_space)
        return {"status": proc.returncode, "out": proc.stdout.splitlines(), "err": proc.stderr.splitlines(),
                "seconds": time.monotonic() - t0}

    normal = job(1, ["eval", root / "good.bin", "--batches", "1", "--batch-size", "4"])
    assert normal["status"] == 0, normal
    jobs = [(1, argv, by_name["llmc-layers-2^31"].expect)
            for argv in entry_points(by_name["llmc-layers-2^31"], tmp_path / "out").values()]
    jobs.append((2, ["eval", by_name["hf-layers-2^31"].path, "--layout", "1d", "--batches", "1", "--batch-size", "4"],
                 by_name["hf-layers-2^31"].expect))
    for n, argv, expect in jobs:
        result = job(n, argv)
        result["seconds"] -= normal["seconds"]
        assert_one_line(f"{argv[0]} on {n} rank(s)", result, expect)


# --------------------------------------------------------------------------- checkpoint attributes


def converted_checkpoint(root: Path, name: str, **attrs) -> Path:
    """A real mpicube run directory (``convert --to mpicube`` of the tiny
    model) whose checkpoint's root attributes are then set to ``attrs``."""
    src = root / "tiny.bin"
    if not src.exists():
        write_llmc(src, random_gpt2(TINY, seed=4), TINY)
    run = root / name
    convert(src, run, "mpicube")
    with h5py.File(run / "ckpt" / "step_00000000" / "checkpoint.h5", "r+") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
    return run


ATTRIBUTE_CASES = [
    ("adam_t-string", {"adam_t": "x"}, r"attribute 'adam_t' is 'x', not an integer"),
    ("batch-size-string", {"train": json.dumps({"batch_size": "eight"})},
     r"attribute 'train' batch_size is 'eight', not an integer from 1"),
    ("data-step-negative", {"data": json.dumps({"step": -5})}, r"attribute 'data' step is -5, not an integer from 0"),
    ("data-path-number", {"data": json.dumps({"step": 0, "path": 5})}, r"attribute 'data' path is 5, not a file name"),
    ("loss-scale-nan", {"loss_scale": json.dumps({"scale": float("nan"), "good_steps": 0, "skipped": 0})},
     r"attribute 'loss_scale' scale is nan, not a finite number"),
    ("train-not-json", {"train": "{oops"}, r"attribute 'train' is '\{oops', not a JSON object"),
    ("config-float-width", {"config": json.dumps({**TINY.to_dict(), "n_embd": 32.7})},
     r"attribute 'config': n_embd is 32.7, not an integer in 1..2147483647"),
    ("config-2^31-layers", {"config": json.dumps({**TINY.to_dict(), "n_layer": 2 ** 31 - 1})},
     r"has no tensor 'model/h.1.ln_1.weight'.*describes n_layer 2,147,483,647"),
]


def test_checkpoint_attributes_of_the_wrong_type_are_one_line(tmp_path, corpus_cache):
    argvs, expects = [], []
    for name, attrs, expect in ATTRIBUTE_CASES:
        run = converted_checkpoint(tmp_path, name, **attrs)
        argvs += [["eval", run, "--batches", "1"],
                  ["train", "--resume", "--out", run, "--steps", "1", "--seq-len", "16"]]
        expects += [(f"{name} via eval", expect), (f"{name} via train --resume", expect)]
    # inspect reports a checkpoint's problems (exit 1) instead: a config that lies about the layers is one
    lying = [converted_checkpoint(tmp_path, f"inspect-{n}", config=json.dumps({**TINY.to_dict(), "n_layer": n}))
             for n in (2 ** 31 - 1, 100_000)]
    results = run_limited(tmp_path, argvs + [["inspect", run] for run in lying], corpus_cache)["results"]
    assert len(results) == len(argvs) + len(lying), results
    for (name, expect), result in paired(expects, results[:len(expects)]):
        assert_one_line(name, result, expect)
    for result in results[len(expects):]:
        assert result["status"] == 1 and result["seconds"] < SECONDS, result
        assert any(re.search(r"PROBLEM: .*'config' does not describe a model: it describes n_layer .* but there "
                             r"is no tensor 'model/h.1.ln_1.weight'", line) for line in result["out"]), result


def test_eval_of_nan_weights_prints_json_null(tmp_path, corpus_cache):
    tensors = random_gpt2(TINY, seed=1)
    tensors["h.0.mlp.c_fc.weight"][0, 0] = np.nan
    write_llmc(tmp_path / "nan.bin", tensors, TINY)
    [result] = run_limited(tmp_path, [["eval", tmp_path / "nan.bin", "--batches", "1", "--batch-size", "4"]],
                           corpus_cache)["results"]
    assert result["status"] == 0, result
    doc = json.loads(result["out"][-1], parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert doc["loss"] is None and doc["tokens"] == 4 * TINY.n_ctx
    assert "not finite" in result["out"][-2] and '"loss" is null' in result["out"][-2], result


# --------------------------------------------------------------------------- property-based tests

# JSON values of every kind, with the ones that broke parsers before: null,
# {}, huge ints, inf and nan (what json makes of 1e400 and NaN), strings.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-2 ** 80, 2 ** 80) | st.sampled_from([0, 1, 2, 16])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
HF_KEYS = ["model_type", "n_layer", "n_head", "n_embd", "n_positions", "n_ctx", "vocab_size", "layer_norm_epsilon",
           "n_inner", "activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
           "add_cross_attention", "tie_word_embeddings", "is_encoder_decoder"]
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


def valid(cfg: ModelConfig) -> bool:
    sizes = cfg.to_dict().values()
    return all(type(v) is int and v >= 1 for v in sizes) and cfg.n_embd % cfg.n_head == 0


@settings(max_examples=100, **FUZZ)
@given(overrides=st.dictionaries(st.sampled_from(HF_KEYS), JSON, max_size=4),
       dropped=st.sets(st.sampled_from(HF_KEYS), max_size=2), whole=st.none() | JSON)
def test_hf_config_parser_gives_a_config_or_its_own_error(overrides, dropped, whole):
    doc = {k: v for k, v in {**hf_config(TINY), **overrides}.items() if k not in dropped}
    if whole is not None and not isinstance(whole, dict):
        doc = whole                          # not even an object
    try:
        cfg = hf.parse_config(Path("fuzz"), doc)
    except FormatError as e:
        assert "\n" not in str(e)
        return
    assert valid(cfg)


HEADER_FIELD = st.integers(-2 ** 31, 2 ** 31 - 1) | st.sampled_from([0, 1, 2, 3, 5, 16, 128, 256, 2 ** 31 - 1])


@settings(max_examples=200, **FUZZ)
@given(fields=st.lists(HEADER_FIELD, min_size=8, max_size=8),
       magic=st.sampled_from([llmc.MAGIC, llmc.TOKEN_SHARD_MAGIC, 0]), version=st.sampled_from([3, 5, 2]),
       raw=st.none() | st.binary(max_size=40), size=st.none() | st.integers(0, 2 ** 64))
def test_llmc_header_parser_gives_a_config_or_its_own_error(fields, magic, version, raw, size):
    header = np.zeros(llmc.HEADER_INTS, "<i4")
    header[:8] = [magic, version] + fields[2:]
    head = header.tobytes() if raw is None else raw
    max_t, vocab, layers, heads, channels, padded = fields[2:]
    if size is None:                         # the size an honest file of this header has
        n = vocab * channels + max_t * channels + layers * (12 * channels ** 2 + 13 * channels) + 2 * channels
        size = 1024 + (4 if version == 3 else 2) * (n + (padded - vocab) * channels)
    try:
        cfg, got_version, vocab_padded = llmc.parse_header(Path("fuzz.bin"), head, size)
    except FormatError as e:
        assert "\n" not in str(e)
        return
    assert valid(cfg) and got_version in llmc.VERSIONS and vocab_padded >= cfg.vocab_size
    assert size == llmc.HEADER_BYTES + llmc.data_bytes(cfg, vocab_padded, got_version)


@settings(max_examples=50, **FUZZ)
@given(doc=st.dictionaries(st.sampled_from(list(TINY.to_dict())), JSON, max_size=5))
def test_checkpoint_config_gives_a_config_or_a_value_error(doc):
    try:
        cfg = ModelConfig.from_dict({**TINY.to_dict(), **doc})
    except ValueError:
        return
    assert all(type(v) is int and v >= 1 for v in cfg.to_dict().values())


# --------------------------------------------------------------------------- pruning after a resume


def save_steps(run: Path, steps, keep):
    block = [checkpoint.Block(name="model/w", local=np.ones(2), shape=(2,), index=(np.arange(2),))]
    for s in steps:
        checkpoint.save(run, s, block, {"config": "{}"}, keep=keep)


def point_latest(run: Path, step: int):
    (run / "ckpt" / "latest").write_text(f"step_{step:08d}\n")


def steps_in(path: Path) -> list:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("step_")) if path.is_dir() else []


def test_a_resumed_run_prunes_the_steps_it_abandoned(tmp_path):
    """Steps 1-6 saved, the run resumed from step 4 (an older ``latest``):
    saving step 5 with --keep 3 removes the abandoned step 6 and keeps this
    run's 3 newest, 3 to 5; before, step 6 survived and step 3 was pruned."""
    save_steps(tmp_path, range(1, 7), keep=None)
    point_latest(tmp_path, 4)
    save_steps(tmp_path, [5], keep=3)
    assert steps_in(tmp_path / "ckpt") == ["step_00000003", "step_00000004", "step_00000005"]
    assert checkpoint.latest(tmp_path).name == "step_00000005"


def test_a_run_that_keeps_all_sets_abandoned_steps_aside(tmp_path):
    save_steps(tmp_path, range(1, 4), keep=None)
    point_latest(tmp_path, 1)
    save_steps(tmp_path, [2], keep=None)
    assert steps_in(tmp_path / "ckpt") == ["step_00000001", "step_00000002"]
    assert steps_in(tmp_path / "ckpt" / "abandoned") == ["step_00000003"]
    assert checkpoint.latest(tmp_path).name == "step_00000002"
    shutil.rmtree(tmp_path / "ckpt" / "step_00000002")
    (tmp_path / "ckpt" / "latest").unlink()
    assert checkpoint.latest(tmp_path).name == "step_00000001"     # the fallback never takes an abandoned step


@pytest.mark.parametrize("cfg", [TINY, ModelConfig(50, 8, 3, 2, 8), ModelConfig(50257, 32, 2, 4, 16)])
def test_arithmetic_sizes_match_the_lists_they_replace(cfg):
    """The lazy names and the llm.c byte count, which run before any list is
    built, agree with the lists the readers build afterwards."""
    from mpicube.model.gpt import gpt_params, param_names

    assert list(param_names(cfg)) == [d.name for d in gpt_params(cfg)]
    for padded in (cfg.vocab_size, llmc.padded_vocab(cfg.vocab_size)):
        listed = sum(math.prod(shape) for _, shape, _ in llmc.file_layout(cfg, padded))
        assert llmc.data_bytes(cfg, padded, llmc.FLOAT32) == 4 * listed
        assert llmc.data_bytes(cfg, padded, llmc.BFLOAT16) == 2 * listed


def test_memory_figures_never_overflow():
    from mpicube.core import memory

    assert memory.format_bytes(3 << 40) == "3.0 TiB" and memory.format_bytes(10 ** 5000).startswith("about 2^")
    assert memory.format_count(10 ** 5000).startswith("about 2^") and memory.format_count(1234) == "1,234"
    huge = ModelConfig(vocab_size=10 ** 4000, n_ctx=1, n_layer=10 ** 4000, n_head=1, n_embd=10 ** 4000)
    assert huge.n_params() > 0 and math.log2(memory.tensor_count(huge.n_layer)) > 13000
    with pytest.raises(Exception) as e:
        memory.require_tensors(huge.n_layer)
    assert "needs at least about 2^" in str(e.value) and "\n" not in str(e.value)

