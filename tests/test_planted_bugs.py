"""The catalogue of planted bugs (issue 35 item 7), in mpicube's own code
path: each real class of parallel-training bug, planted from outside the
package by tests/planted_bug.py, is named by `compare` against the serial
trace at the first tensor it makes wrong - also where the loss still
agrees, and with the ranks whose replicas part where the bug leaves
replicated copies different.

One 2-rank launch of one traced step per bug (a bug changes the process,
so each needs its own), on a tiny model; the references are two serial
traces. The same bugs planted in a PyTorch DTensor model are in
tests/test_check_dtensor.py.
"""

import pytest
from conftest import MpiCube, last_json

from test_trace import REPO

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--seq-len", "8", "--batch-size", "8",
         "--dtype", "float64", "--dropout", "0.1", "--seed", "5", "--warmup", "2", "--steps", "1"]

# bug, reference, layout options, the first divergence, rows that must still agree, a note its row must hold
CATALOGUE = [
    ("sp-grad", "ref.h5", ["--layout", "1d", "--sequence-parallel"], "step_1/grad/ln_f.weight",
     ["step_1/loss", "step_1/logits"], "replicas part: ranks 0 and 1"),
    ("scale=dp", "ref.h5", ["--layout", "1d", "--dp", "2"], "step_1/grad/ln_f.weight", ["step_1/loss"], ""),
    ("scale=cp", "ref.h5", ["--layout", "1d", "--cp", "2"], "step_1/grad/ln_f.weight", ["step_1/loss"], ""),
    ("norm-replicas", "ref.h5", ["--layout", "1d"], "step_1/grad_norm",
     ["step_1/loss", "step_1/grad/wte", "step_1/grad/h.0.ln_1.weight"], ""),
    ("tied-order", "ref.h5", ["--layout", "1d", "--pp", "2"], "step_1/grad/wte",
     ["step_1/loss", "step_1/grad/wpe"], "replicas part: ranks 0 and 1"),
    ("qkv-split", "ref.h5", ["--layout", "1d"], "step_1/act/h.0.attn",
     ["init/h.0.attn.c_attn.weight", "step_1/act/h.0.ln_1"], ""),
    ("dropout-rank", "ref.h5", ["--layout", "1d", "--dp", "2"], "step_1/dropout/emb", ["tokens"], ""),
    ("vocab-pad", "ref257.h5", ["--layout", "1d", "--vocab-size", "257"], "step_1/loss", ["step_1/logits"], ""),
]


@pytest.fixture(scope="module")
def runner(tmp_path_factory, corpus_cache) -> MpiCube:
    runner = MpiCube(tmp_path_factory.mktemp("planted"), corpus_cache)
    runner.env["MPIEXEC_TIMEOUT"] = "120"
    for out, extra in (("ref.h5", []), ("ref257.h5", ["--vocab-size", "257"])):
        r = runner.run("trace", "--layout", "serial", *MODEL, *extra, "--out", out)
        assert r.returncode == 0, r
    return runner


@pytest.mark.timeout(200)
@pytest.mark.parametrize("bug,ref,options,first,agree,note", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_a_planted_bug_is_named_at_the_first_tensor_it_spoils(runner, bug, ref, options, first, agree, note):
    out = bug.replace("=", "-") + ".h5"
    cmd = runner.command("trace", *MODEL, *options, "--sharded", "--out", out, n=2)
    at = cmd.index("-m")
    cmd[at:at + 2] = [str(REPO / "tests" / "planted_bug.py"), bug]
    r = runner.run(cmd=cmd, timeout=150)
    assert r.returncode == 0, r
    r = runner.run("compare", ref, out)
    assert r.returncode == 1, r
    assert r.stdout.strip().splitlines()[-1].startswith(f"first divergence: {first} ("), r.stdout
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("step_1/", "init/", "tokens"))}
    assert all(rows[name].endswith(" yes") for name in agree), [rows[n] for n in agree]
    assert note in rows[first], rows[first]
    r = runner.run("compare", ref, out, "--json")
    assert last_json(r.stdout)["first_divergence"] == first
