"""Strong and weak scaling of mpicube's 1-D, 2-D, 2.5-D and 3-D layouts.

    PYTHONPATH=. python tools/scaling.py --out tools/out              # analytic (default)
    PYTHONPATH=. python tools/scaling.py --measure --out tools/out    # runs `mpicube bench` per point

Analytic mode prices every point with ``mpicube.analysis.costmodel`` (communication
and memory per rank per step, exact: the test suite checks them against
mpicube's counters) and is instant at any world size. Measure mode launches
``mpiexec -n P python -m mpicube bench ... --json`` for every point, records
step time, communication and memory, and checks the measured communication
against the cost model.

Points: 1d at p = 2^k, 2d at p = q^2, 2.5d at p = q^3 with depth d = q,
3d at p = q^3, and the serial layout at p = 1 as the common baseline (the
cost model over-counts 2d/2.5d/3d at tp = 1, where gathered buffers alias
the parameters; docs/performance.md). Points the model sizes do not divide
are skipped with mpicube's own message.

Strong scaling: one model and one global batch for every p.
Weak scaling, rule "batch" (default): global batch B = b0 * p at a fixed
model, so every rank does exactly the same FLOPs at every p. Rule "hidden":
n_embd grows like sqrt(p) (rounded to the sizes every layout accepts) at a
fixed batch, so weights per rank stay roughly constant; the CSV's
flops_per_rank column shows how far from constant the work per rank is.

Outputs in --out: scaling_<mode>.csv and PNG plots <mode>_<scaling>_comm.png,
_memory.png and (measured) _step_time.png: per rank vs p, log-log, one line
per layout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

from mpicube.core.config import ModelConfig  # noqa: E402

import perfmodel as pm  # noqa: E402

COLUMNS = [
    "scaling", "rule", "layout", "p", "q", "d", "n_layer", "n_head", "n_embd", "seq_len", "batch", "vocab_size",
    "flops_per_rank", "comm_elems", "comm_msgs", "comm_bytes", "comm_by_axis",
    "mem_params", "mem_grads", "mem_optimizer", "mem_activations", "mem_total", "mem_total_bytes",
    "step_time_s", "tokens_per_s", "measured_comm_elems", "measured_comm_msgs", "comm_check",
    "measured_mem_params", "measured_mem_activations", "mem_check", "note",
]
BYTES = {"float32": 4, "float64": 8}
MARKERS = {"1d": "o", "2d": "s", "2.5d": "^", "3d": "D"}
ORDER = ("serial",) + pm.LAYOUTS


# --------------------------------------------------------------------------- the sweep


def points(args) -> list:
    """Every (scaling, rule, layout, p, depth, cfg, batch) the sweep visits:
    the serial baseline at p = 1, then each layout's valid sizes."""
    scalings = ("strong", "weak") if args.scaling == "both" else (args.scaling,)
    grid = [("serial", 1, 1)]
    for lay in args.layouts:
        grid += [(lay, p, d) for p, d in pm.grid_sizes(lay, args.max_p_3d if lay == "3d" else args.max_p)]
    base = ModelConfig(vocab_size=args.vocab_size, n_ctx=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    # hidden-rule sizes are multiples of n_head and of q^2 for every 3-D point (n_embd % q^2 == 0)
    unit = math.lcm(args.n_head, *[pm.side("3d", p) ** 2 for lay, p, _ in grid if lay == "3d"])
    out = []
    for scaling in scalings:
        if scaling == "strong":
            rule = "fixed model and batch"
        elif args.weak_rule == "batch":
            rule = f"B = {args.weak_batch} p"
        else:
            rule = f"h ~ {args.n_embd} sqrt(p)"
        for lay, p, depth in grid:
            cfg, batch = base, args.batch_size
            if scaling == "weak" and args.weak_rule == "batch":
                batch = args.weak_batch * p
            elif scaling == "weak":
                h = unit * max(1, round(args.n_embd * math.sqrt(p) / unit))
                cfg = ModelConfig(vocab_size=args.vocab_size, n_ctx=args.seq_len, n_layer=args.n_layer,
                                  n_head=args.n_head, n_embd=h)
            out.append(dict(scaling=scaling, rule=rule, layout=lay, p=p, depth=depth, cfg=cfg, batch=batch))
    return out


def analytic_row(pt: dict, bytes_per_elem: int) -> dict:
    cfg, lay, p = pt["cfg"], pt["layout"], pt["p"]
    row = dict(scaling=pt["scaling"], rule=pt["rule"], layout=lay, p=p, q=pm.side(lay, p, pt["depth"]), d=pt["depth"],
               n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, seq_len=cfg.n_ctx,
               batch=pt["batch"], vocab_size=cfg.vocab_size)
    prob = pm.make_problem(lay, cfg, pt["batch"], p, pt["depth"])
    if isinstance(prob, str):
        row["note"] = "skipped: " + prob
        return row
    elems, msgs, by_axis = pm.traffic_totals(prob)
    mem = pm.memory(prob)
    row.update(flops_per_rank=int(pm.flops_per_rank(prob)), comm_elems=_num(elems), comm_msgs=msgs,
               comm_bytes=_num(elems * bytes_per_elem),
               comm_by_axis=";".join(f"{a}={_num(e)}" for a, e in sorted(by_axis.items())),
               mem_params=mem["params"], mem_grads=mem["grads"], mem_optimizer=mem["optimizer"],
               mem_activations=mem["activations"], mem_total=mem["total"],
               mem_total_bytes=mem["total"] * bytes_per_elem)
    row["_problem"] = prob
    row["_elems"] = elems
    return row


def _num(x):
    """Exact counts stay integers; a Fraction that is not whole is written as a float."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


# --------------------------------------------------------------------------- measuring


def find_mpiexec(explicit):
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def job_env(timeout: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["MPIEXEC_TIMEOUT"] = str(timeout)
    env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"   # MPICH yields instead of spinning: oversubscribed ranks
    return env


def bench_command(args, pt: dict) -> list:
    cfg = pt["cfg"]
    cmd = [find_mpiexec(args.mpiexec), "-n", str(pt["p"]), args.python, "-m", "mpicube", "bench",
           "--layout", pt["layout"], "--dp", "1"]
    if pt["layout"] == "2.5d":
        cmd += ["--depth", str(pt["depth"])]
    cmd += ["--n-layer", cfg.n_layer, "--n-head", cfg.n_head, "--n-embd", cfg.n_embd, "--seq-len", cfg.n_ctx,
            "--batch-size", pt["batch"], "--warmup-steps", args.warmup_steps, "--steps", args.steps,
            "--dtype", args.dtype, "--json"]
    return [str(c) for c in cmd]


def check_bench(args) -> None:
    """Exit with a clear message when this mpicube has no `bench` command."""
    proc = subprocess.run([args.python, "-m", "mpicube", "bench", "--help"], capture_output=True, text=True,
                          env=job_env(60), cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"scaling.py --measure needs `mpicube bench`, which failed here: {tail[0]}")


def parse_bench(stdout: str, layout: str) -> dict:
    """The JSON object on the last non-empty stdout line; the result entry of
    ``layout`` (or the top level when there is no ``results`` list)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("no output")
    doc = json.loads(lines[-1])
    results = doc.get("results") or [doc]
    for res in results:
        if res.get("layout") == layout:
            return {**doc, **res}
    return {**doc, **results[0]}


def measure(args, pt: dict, row: dict) -> None:
    """Run one point under mpiexec and add the measured columns to ``row``."""
    cmd = bench_command(args, pt)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(args.timeout), cwd=ROOT,
                              timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        row["note"] = f"bench timed out after {args.timeout + 30} s"
        return
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["?"])[-1]
        row["note"] = f"bench failed (exit {proc.returncode}): {msg}"
        return
    try:
        res = parse_bench(proc.stdout, pt["layout"])
    except (ValueError, json.JSONDecodeError) as err:
        row["note"] = f"bench output not understood: {err}"
        return
    row["step_time_s"] = res.get("step_time_s")
    row["tokens_per_s"] = res.get("tokens_per_s")
    comm, mem = res.get("comm") or {}, res.get("memory") or {}
    row["measured_comm_elems"] = comm.get("measured_elems")
    row["measured_comm_msgs"] = comm.get("measured_msgs")
    row["comm_check"] = comm_check(comm, row["_elems"], row["comm_msgs"])
    # bench reports the model's figures as params/activations and the counted ones as measured_*
    got = (mem.get("measured_params", mem.get("params")), mem.get("measured_activations", mem.get("activations")))
    if mem:
        row["measured_mem_params"], row["measured_mem_activations"] = got
        row["mem_check"] = "exact" if got == (row["mem_params"], row["mem_activations"]) else "MISMATCH"
    row["note"] = f"wall {wall:.1f} s"


def comm_check(comm: dict, want_e: Fraction, want_m: int) -> str:
    """Measured communication of one step against this cost model:
    "exact", or "MISMATCH ...". JSON carries the element count as a float,
    so it is compared with the exact prediction to float precision (the
    bench's own ``exact`` flag compares the Fractions)."""
    got_e, got_m = comm.get("measured_elems"), comm.get("measured_msgs")
    if got_e is None or got_m is None:
        return "no measurement"
    same_e = abs(float(got_e) - float(want_e)) <= 1e-12 * max(1.0, float(want_e))
    if not (same_e and int(got_m) == want_m):
        return f"MISMATCH (measured {got_e} elems / {got_m} msgs)"
    if comm.get("exact") is False:
        return "MISMATCH (bench: counters != its prediction)"
    return "exact"


# --------------------------------------------------------------------------- output


def write_csv(rows: list, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})


def _fmt(n) -> str:
    if n is None or n == "":
        return "-"
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def print_table(rows: list, scaling: str, measured: bool) -> None:
    head = f"  {'layout':<6} {'p':>4} {'q':>3} {'d':>2} {'batch':>6} {'h':>6} {'comm elems':>11} {'msgs':>7} " \
           f"{'memory':>9} {'act.':>9}"
    if measured:
        head += f" {'step s':>8} {'comm':>6} {'memory':>6}"
    print(head)
    for r in rows:
        if r["scaling"] != scaling:
            continue
        if "comm_elems" not in r:
            print(f"  {r['layout']:<6} {r['p']:>4}  {r['note']}")
            continue
        line = (f"  {r['layout']:<6} {r['p']:>4} {r['q']:>3} {r['d']:>2} {r['batch']:>6} {r['n_embd']:>6} "
                f"{_fmt(r['comm_elems']):>11} {r['comm_msgs']:>7} {_fmt(r['mem_total']):>9} "
                f"{_fmt(r['mem_activations']):>9}")
        if measured:
            st = r.get("step_time_s")
            line += (f" {(f'{st:.3f}' if isinstance(st, (int, float)) else '-'):>8} "
                     f"{r.get('comm_check') or '-':>6} {r.get('mem_check') or '-':>6}")
            if r.get("note", "").startswith("bench"):
                line += "  " + r["note"]
        print(line)


def plot(rows: list, out: Path, scaling: str, title: str, bytes_per_elem: int, measured: bool) -> list:
    """PNG files MODE_SCALING_{comm,memory,step_time}.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    rows = [r for r in rows if r["scaling"] == scaling and "comm_elems" in r]
    layouts = [lay for lay in ORDER if any(r["layout"] == lay for r in rows)]
    ps = sorted({r["p"] for r in rows})

    def series(ax, key, transform=lambda v: v, label_suffix=""):
        for lay in layouts:
            pts = [(r["p"], transform(r, key)) for r in rows if r["layout"] == lay]
            pts = [(p, v) for p, v in pts if isinstance(v, (int, float)) and v > 0]
            if pts and lay == "serial":
                ax.plot(*zip(*pts), marker="*", markersize=12, color="black", linestyle="", label="serial (p=1)")
            elif pts:
                ax.plot(*zip(*pts), marker=MARKERS[lay], label=lay + label_suffix)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ps))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.tick_params(axis="x", labelsize=8, labelrotation=60 if len(ps) > 8 else 0)
        ax.set_xlabel("ranks p")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()

    get = lambda r, k: r.get(k)  # noqa: E731
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series(axes[0], "comm_elems", lambda r, k: r[k] * bytes_per_elem)
    axes[0].set_ylabel(f"bytes per rank per step ({bytes_per_elem} B/element)")
    axes[0].set_title("communication volume")
    series(axes[1], "comm_msgs", get)
    axes[1].set_ylabel("messages (ring steps) per rank per step")
    axes[1].set_title("messages")
    fig.suptitle(f"{scaling} scaling: communication per rank ({title})")
    fig.tight_layout()
    prefix = f"{'measured' if measured else 'analytic'}_{scaling}"
    written.append(out / f"{prefix}_comm.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series(axes[0], "mem_total", lambda r, k: r[k] * bytes_per_elem)
    axes[0].set_title("total")
    series(axes[1], "mem_params", lambda r, k: (r["mem_params"] + r["mem_grads"] + r["mem_optimizer"]) * bytes_per_elem)
    axes[1].set_title("parameters + gradients + AdamW moments")
    series(axes[2], "mem_activations", lambda r, k: r[k] * bytes_per_elem)
    axes[2].set_title("activations kept for backward")
    axes[0].set_ylabel(f"bytes per rank ({bytes_per_elem} B/element)")
    fig.suptitle(f"{scaling} scaling: memory per rank ({title})")
    fig.tight_layout()
    written.append(out / f"{prefix}_memory.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if measured and any(isinstance(r.get("step_time_s"), (int, float)) for r in rows):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        series(ax, "step_time_s", get)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{scaling} scaling: measured step time\n({title}; oversubscribed CPU ranks)", fontsize=10)
        fig.tight_layout()
        written.append(out / f"{prefix}_step_time.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def describe(args, scaling: str) -> str:
    model = f"L={args.n_layer} heads={args.n_head} T={args.seq_len} V={args.vocab_size}"
    if scaling == "strong":
        return f"{model} h={args.n_embd} B={args.batch_size}"
    if args.weak_rule == "batch":
        return f"{model} h={args.n_embd} B={args.weak_batch}*p"
    return f"{model} h~{args.n_embd}*sqrt(p) B={args.batch_size}"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--analytic", action="store_true", help="cost model only (the default)")
    mode.add_argument("--measure", action="store_true", help="run `mpiexec -n P python -m mpicube bench` per point")
    ap.add_argument("--out", type=Path, default=HERE / "out", help="folder for the CSV and plots")
    ap.add_argument("--scaling", choices=("strong", "weak", "both"), default="both")
    ap.add_argument("--layouts", nargs="+", choices=pm.LAYOUTS, default=list(pm.LAYOUTS))
    ap.add_argument("--max-p", type=int, default=None,
                    help="largest p for 1d/2d/2.5d [default: 64 analytic, 27 measured]")
    ap.add_argument("--max-p-3d", type=int, default=64, help="largest p for 3d")
    ap.add_argument("--n-layer", type=int, default=None, help="[default: 2 analytic, 1 measured]")
    ap.add_argument("--n-head", type=int, default=None,
                    help="[default: 192 analytic (a multiple of 64 and 3: 1d to p=64, cubes to q=4); "
                         "48 measured (1d to p=16)]")
    ap.add_argument("--n-embd", type=int, default=None,
                    help="multiple of n_head and of q^2 for the cubes [default: 576 analytic, 144 measured]")
    ap.add_argument("--seq-len", type=int, default=None, help="[default: 16 analytic, 8 measured]")
    ap.add_argument("--batch-size", type=int, default=144,
                    help="strong scaling's global batch (144 = lcm(16, 9) divides every point up to q = 4)")
    ap.add_argument("--vocab-size", type=int, default=256, help="256: mpicube's byte tokenizer")
    ap.add_argument("--weak-rule", choices=("batch", "hidden"), default="batch",
                    help="batch: B = WEAK_BATCH * p; hidden: n_embd ~ N_EMBD * sqrt(p)")
    ap.add_argument("--weak-batch", type=int, default=4, help="sequences per rank in batch-rule weak scaling")
    ap.add_argument("--dtype", choices=tuple(BYTES), default="float32")
    ap.add_argument("--steps", type=int, default=3, help="timed bench steps (measure)")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed bench steps (measure)")
    ap.add_argument("--timeout", type=int, default=600, help="MPIEXEC_TIMEOUT per bench run, seconds")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    ap.add_argument("--mpiexec", default=None, help="[default: the one beside the interpreter, else on PATH]")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    # measured runs are 1..64 processes on a few cores: a smaller model by default
    defaults = dict(max_p=27, n_layer=1, n_head=48, n_embd=144, seq_len=8) if args.measure else \
        dict(max_p=64, n_layer=2, n_head=192, n_embd=576, seq_len=16)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    bytes_per_elem = BYTES[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "measured" if args.measure else "analytic"
    if args.measure:
        check_bench(args)
    rows = []
    for pt in points(args):
        row = analytic_row(pt, bytes_per_elem)
        if args.measure and "_problem" in row:
            print(f"  bench {pt['scaling']} {pt['layout']} p={pt['p']} ...", flush=True)
            measure(args, pt, row)
        rows.append(row)
    csv_path = args.out / f"scaling_{mode}.csv"
    write_csv(rows, csv_path)
    print(f"mpicube scaling ({mode}); per rank per step; elements of {args.dtype} "
          f"({bytes_per_elem} B); comm = elements each rank sends (ring convention)")
    scalings = ("strong", "weak") if args.scaling == "both" else (args.scaling,)
    written = [csv_path]
    for scaling in scalings:
        print(f"\n{scaling} scaling: {describe(args, scaling)}")
        print_table(rows, scaling, args.measure)
        if not args.no_plots:
            written += plot(rows, args.out, scaling, describe(args, scaling), bytes_per_elem, args.measure)
    if args.measure:
        checked = [r for r in rows if r.get("comm_check")]
        bad_comm = [f"{r['scaling']} {r['layout']} p={r['p']}" for r in checked if r["comm_check"] != "exact"]
        bad_mem = [f"{r['scaling']} {r['layout']} p={r['p']}" for r in checked if r.get("mem_check") != "exact"]
        failed = [r for r in rows if (r.get("note") or "").startswith("bench")]
        print(f"\ncheck: measured communication (total elements and messages per step, all axes) equals the cost model at "
              f"{len(checked) - len(bad_comm)} of {len(checked)} points"
              + (f"; NOT at {', '.join(bad_comm)}" if bad_comm else ""))
        print(f"check: measured parameters and saved activations equal the memory model at "
              f"{len(checked) - len(bad_mem)} of {len(checked)} points" + (f"; NOT at {', '.join(bad_mem)}" if bad_mem else ""))
        if failed:
            print(f"{len(failed)} bench runs failed; see the note column of {csv_path}")
    skipped = [r for r in rows if (r.get("note") or "").startswith("skipped")]
    if skipped:
        print(f"\n{len(skipped)} points skipped (sizes do not divide); reasons in the note column")
    print("\nwrote " + ", ".join(str(p) for p in written))
    mismatch = any("MISMATCH" in (r.get("comm_check") or "") + (r.get("mem_check") or "") for r in rows)
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
