"""Plant realistic bugs one at a time in a copy of the tree and say which
ones the tests covering that code miss (``make mutants``; issue 48).

    python tools/mutants.py                 # every mutant of the catalogue
    python tools/mutants.py shards-sorted z-loss-accum      # some, by name
    python tools/mutants.py --list          # the catalogue
    python tools/mutants.py --no-baseline   # skip running each test set on the unmutated copy first

A mutant is one textual edit: in ``file``, the one occurrence of
``pattern`` becomes ``replacement``. Kept as plain text so that whoever
moves the code can update the pattern beside the move; a pattern found
zero times or more than once is reported STALE, never silently skipped.
Each mutant names the tests that cover its code (pytest arguments, run
from the copy's root with the copy first on PYTHONPATH, ``-x``: the first
failure kills it). ``plain`` mutants run with torch, transformers and
torchao hidden (as on a machine without the ``check`` extra), because the
point is that ``make test`` catches them there too.

The tree is copied once (git's tracked and untracked-but-not-ignored
files, modification times kept, plus numba's compiled kernels of
mpicube/device so that the copy does not recompile them); each mutant is
applied, its tests run, and the file restored. Before the mutants, each
distinct test set runs on the unmutated copy (the baseline): a test that
fails there would kill every mutant and prove nothing, so the run stops.

Why a script and not a mutation tool: mutmut and cosmic-ray generate
operator mutants (``+`` to ``-``, a constant off by one) by the thousand
and run the whole suite per mutant. mpicube's suite is MPI launches on a
2-core budget of 30 minutes, and the bugs worth planting are the ones
framework users hit (a sum taken as a mean over a group, a missing
1/grad-accum, two tensors swapped in a name table), which no operator
generates; a short catalogue of those, each with the few tests that
cover it, runs in minutes. Exit status: 0 when every mutant is killed,
1 when one survives or is stale, 2 on bad arguments or a failing baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str             # relative to the repository root
    pattern: str          # must occur exactly once in file
    replacement: str
    tests: tuple          # pytest arguments that cover it
    why: str
    plain: bool = False   # run with torch/transformers hidden


TRACE_EP = ("tests/test_moe_trace.py", "-k", "traces_equal_serial")
ACCUM = ("tests/test_moe.py", "-k", "accumulated")
HF = ("tests/test_hf_layouts.py", "tests/test_check_maps.py", "tests/test_hf_mixtral.py", "tests/test_hf_llama.py",
      "tests/test_formats.py", "-k", "not every_layout and not init_from and not several_ranks")

CATALOGUE = [
    Mutant("expert-grad-mean", "mpicube/parallel/gradients.py",
           "store.flat_grad[experts] = self.axes.edp.allreduce(store.flat_grad[experts], wire=wire)",
           "store.flat_grad[experts] = self.axes.edp.allreduce(store.flat_grad[experts], wire=wire) "
           "/ self.axes.edp.size",
           TRACE_EP, "--zero 0 with ep < dp: expert gradients averaged over the expert-data group (pytorch #160285)"),
    Mutant("z-loss-grad-accum", "mpicube/model/router.py",
           "(self.cfg.n_layer * self.micro_tokens * self.grad_accum))",
           "(self.cfg.n_layer * self.micro_tokens))",
           ACCUM, "the z-loss gradient not divided by --grad-accum"),
    Mutant("aux-loss-grad-accum", "mpicube/model/router.py",
           "(self.grad_accum * LN * LN))", "(LN * LN))",
           ACCUM, "the load-balancing loss's gradient on the router probabilities not divided by --grad-accum"),
    Mutant("z-loss-value-accum", "mpicube/model/router.py",
           "self.z_loss() / self.grad_accum", "self.z_loss()",
           ACCUM, "the z-loss counted once per micro-batch in the step's loss"),
    Mutant("depth-bound-inverted", "mpicube/check/tolerance.py",
           "DEPTH_FACTOR * UNIT_ROUNDOFF[dtype] * max(1, depth)",
           "DEPTH_FACTOR * UNIT_ROUNDOFF[dtype] / max(1, depth)",
           ("tests/test_check.py", "tests/test_trace.py", "-k", "depth"),
           "the depth-aware bound divided by the depth instead of multiplied"),
    Mutant("shards-sorted", "mpicube/check/shards.py",
           'ix = member[f"index_{d}"][()].astype(np.int64)',
           'ix = np.sort(member[f"index_{d}"][()].astype(np.int64))',
           ("tests/test_check_shards.py",), "shards put back in sorted index order, not by their indices"),
    Mutant("shards-replicas-unchecked", "mpicube/check/shards.py",
           "if not problem and again.any():", "if False:",
           ("tests/test_check_shards.py",), "replicated shards never compared with each other"),
    Mutant("nan-one-side", "mpicube/check/compare.py",
           "odd = (~fa | ~fb) & ~same", "odd = (~fa & ~fb) & ~same",
           ("tests/test_check.py",), "a NaN or infinity on one side only is not a divergence"),
    Mutant("mixtral-w1-w3", "mpicube/files/formats/hf_mixtral.py",
           'return [(pe + "w1.weight", cfg.ffn), (pe + "w3.weight", cfg.ffn)], True',
           'return [(pe + "w3.weight", cfg.ffn), (pe + "w1.weight", cfg.ffn)], True',
           HF,
           "Mixtral's w1/w3 (gate/up) swapped in the files' shared read/write table", plain=True),
    Mutant("llama-gate-up", "mpicube/files/formats/hf_llama.py",
           '[(p + "mlp.gate_proj.weight", cfg.ffn), (p + "mlp.up_proj.weight", cfg.ffn)]',
           '[(p + "mlp.up_proj.weight", cfg.ffn), (p + "mlp.gate_proj.weight", cfg.ffn)]',
           HF,
           "Llama's gate_proj/up_proj swapped in the files' shared read/write table", plain=True),
    Mutant("mixtral-hub-map-w1-w3", "mpicube/check/namemaps.py",
           'Rule((f"{p}experts.{e}.w1.weight", f"{p}experts.{e}.w3.weight"), "concat"',
           'Rule((f"{p}experts.{e}.w3.weight", f"{p}experts.{e}.w1.weight"), "concat"',
           HF, "the hf_mixtral_hub name map's w1/w3 swapped", plain=True),
    Mutant("deepseek-expert-gate-up", "mpicube/files/formats/hf_deepseek.py",
           'return [(pe + "gate_proj.weight", F), (pe + "up_proj.weight", F)], True',
           'return [(pe + "up_proj.weight", F), (pe + "gate_proj.weight", F)], True',
           ("tests/test_hf_layouts.py", "tests/test_hf_deepseek.py"),
           "DeepSeek-V3's expert gate_proj/up_proj swapped in the read/write table", plain=True),
    Mutant("trace-ln-swap", "mpicube/analysis/trace_collect.py",
           'INSIDE = {"ln_1": "ln_1", "c_proj": "attn", "ln_2": "ln_2"}',
           'INSIDE = {"ln_1": "ln_2", "c_proj": "attn", "ln_2": "ln_1"}',
           ("tests/test_trace.py", "-k", "serial_trace_holds or inside_a_block or recomputed"),
           "the trace collector names ln_1's output ln_2 and back (serial and layouts alike)", plain=True),
]


def tree_files(root: Path) -> list:
    """The files of the working tree git knows or would add (ignored ones left out)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def copy_tree(root: Path, dst: Path) -> None:
    """The working tree into ``dst``, modification times kept, with numba's
    cached kernels (their index checks the source's time and size)."""
    for rel in tree_files(root):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    cache = root / "mpicube" / "device" / "__pycache__"
    if cache.is_dir():
        (dst / "mpicube" / "device" / "__pycache__").mkdir(parents=True, exist_ok=True)
        for f in cache.iterdir():
            if f.suffix in (".nbi", ".nbc"):
                shutil.copy2(f, dst / "mpicube" / "device" / "__pycache__" / f.name)


def hidden_torch(dst: Path) -> Path:
    """A directory whose torch, transformers and torchao cannot be imported."""
    for name in ("torch", "transformers", "torchao"):
        (dst / name).mkdir(parents=True, exist_ok=True)
        (dst / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{name} hidden by tools/mutants.py (a plain machine)', name='{name}')\n")
    return dst


def run_tests(copy: Path, tests: tuple, plain: bool, hide: Path, timeout: float) -> tuple:
    """(status, seconds, first failing test or last line) of pytest on ``tests`` in ``copy``."""
    path = [str(hide)] if plain else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(copy)]), PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, f"over {timeout:.0f} s"
    lines = proc.stdout.strip().splitlines()
    failed = next((ln.split(" ", 1)[1].split(" - ")[0] for ln in lines if ln.startswith(("FAILED ", "ERROR "))), None)
    return proc.returncode, time.monotonic() - start, failed or (lines[-1] if lines else proc.stderr.strip()[-200:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--no-baseline", action="store_true", help="do not run the test sets unmutated first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the copy of the tree (its path is printed)")
    args = parser.parse_args(argv)
    known = {m.name: m for m in CATALOGUE}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"mutants: unknown mutant {unknown[0]!r}: use one of {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] or CATALOGUE
    if args.list:
        for m in chosen:
            print(f"{m.name:24} {m.file}: {m.why}{' (torch hidden)' if m.plain else ''}\n{'':24} tests: "
                  f"{' '.join(m.tests)}")
        return 0

    work = Path(tempfile.mkdtemp(prefix="mpicube-mutants-"))
    copy, hide = work / "tree", hidden_torch(work / "hidden")
    try:
        copy_tree(ROOT, copy)
        print(f"mutants: {len(chosen)} in a copy of {ROOT} ({copy})", flush=True)
        if not args.no_baseline:
            for tests, plain in dict.fromkeys((m.tests, m.plain) for m in chosen):
                status, secs, note = run_tests(copy, tests, plain, hide, args.timeout)
                print(f"baseline {'ok' if status == 0 else 'FAILS':6} {secs:6.1f}s  {' '.join(tests)}"
                      f"{' (torch hidden)' if plain else ''}{'' if status == 0 else '  ' + str(note)}", flush=True)
                if status != 0:
                    print("mutants: a test set fails without any mutant; fix that first", file=sys.stderr)
                    return 2
        survived = []
        for m in chosen:
            path = copy / m.file
            original = path.read_text() if path.is_file() else ""
            found = original.count(m.pattern)
            if found != 1:
                print(f"STALE    {'':7} {m.name}: pattern found {found} times in {m.file}; update the catalogue",
                      flush=True)
                survived.append(m.name)
                continue
            path.write_text(original.replace(m.pattern, m.replacement))
            try:
                status, secs, note = run_tests(copy, m.tests, m.plain, hide, args.timeout)
            finally:
                path.write_text(original)
                shutil.copystat(ROOT / m.file, path)
            killed = status not in (0, 5)          # 5: no test collected, which kills nothing
            if not killed:
                survived.append(m.name)
            print(f"{'killed' if killed else 'SURVIVED':8} {secs:6.1f}s  {m.name}: {m.why}"
                  f"{' (torch hidden)' if m.plain else ''}\n{'':17}by {note if killed else ' '.join(m.tests)}",
                  flush=True)
        print(f"mutants: {len(chosen) - len(survived)} of {len(chosen)} killed"
              + (f"; survived or stale: {', '.join(survived)}" if survived else ""), flush=True)
        return 1 if survived else 0
    finally:
        if args.keep:
            print(f"mutants: copy kept at {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
