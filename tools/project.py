"""Project mpicube's step time on a V100 cluster like Bian et al.'s.

    PYTHONPATH=. python tools/project.py            # table + sensitivity sweep
    PYTHONPATH=. python tools/project.py --json     # the same, machine-readable

An alpha-beta model priced on mpicube's exact per-rank, per-axis traffic
(``mpicube.analysis.costmodel.step_traffic``):

    step = FLOPs per rank / GPU rate
         + sum over axes (messages * alpha + elements * bytes / bandwidth)

Each axis's communicators are placed on nodes with mpicube's rank placement
(world = dp x tp, tp innermost; the layouts' grid coordinates), 4
consecutive world ranks per node. An axis whose communicators stay inside a
node runs at the NVLink parameters; one that spans nodes runs as a ring
whose slowest edge crosses InfiniBand, and the communicators of that axis
that leave the same node at the same time share its NIC. No overlap of
communication with compute or with other communication. The parameters and
their sources are printed with the result; docs/performance.md discusses
them.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

from mpicube.core.config import ModelConfig  # noqa: E402
from mpicube.analysis.costreport import comparison_depth  # noqa: E402

import perfmodel as pm  # noqa: E402

PAPER = {"1d/3d": 2.32, "2d/3d": 1.57}     # Bian et al., arXiv 2105.14450, 64 V100 GPUs (abstract)

SOURCES = [
    ("flops", "sustained GPU rate", "Megatron-LM's single-V100 baseline sustained 39 TFLOP/s, 30% of the 125 "
     "TFLOP/s fp16 tensor-core peak (Shoeybi et al. 2019, arXiv 1909.08053); fp32 peak is 15.7 TFLOP/s."),
    ("intra_bw", "NVLink ring edge", "A V100 SXM2 has 6 NVLink 2.0 links of 25 GB/s per direction (150 GB/s "
     "aggregate), but one ring uses one edge per GPU, and GPU pairs have 1 to 3 links (DGX-1 hybrid cube mesh: "
     "1-2; 4-GPU POWER9 node: 3 within a socket, none across): 50 GB/s = 2 links."),
    ("nic_bw", "InfiniBand per node", "One EDR port per node, 100 Gb/s = 12.5 GB/s per direction, shared by the "
     "node's GPUs."),
    ("alpha_intra", "latency inside a node", "Per message (ring step): NVLink plus CUDA/MPI software overhead."),
    ("alpha_inter", "latency between nodes", "Per message: EDR's ~1 us plus MPI/NCCL software overhead."),
    ("bytes_per_elem", "element size", "2: float16 mixed precision at its real widths (mpicube.analysis.costmodel): "
                                      "activations, weight copies, gathered panels and their sums in 2 bytes; "
                                      "statistics and gradient all-reduces in float32."),
]
DEFAULTS = pm.Cluster()


def default_cluster(args) -> pm.Cluster:
    return pm.Cluster(name="64 x V100 SXM2, 4 per node, NVLink 2.0 + EDR InfiniBand", gpus_per_node=args.gpus_per_node,
                      flops=args.flops, intra_bw=args.intra_bw, nic_bw=args.nic_bw, alpha_intra=args.alpha_intra,
                      alpha_inter=args.alpha_inter, bytes_per_elem=args.bytes, nic_sharing=args.nic_sharing)


def problems(cfg: ModelConfig, batch: int, world: int, depth: int, dp: int = 1) -> tuple:
    """({layout: Problem}, {layout: why not}) for the four schemes at this
    size; ValueError (with mpicube's message) if 3-D itself does not fit."""
    tp = world // dp
    out, skipped = {}, {}
    for lay in pm.LAYOUTS:
        prob = pm.make_problem(lay, cfg, batch, tp, depth if lay == "2.5d" else 1, dp)
        if isinstance(prob, str):
            skipped[lay] = prob
        else:
            out[lay] = prob
    if "3d" in skipped:
        raise ValueError(skipped["3d"])
    return out, skipped


def project(probs: dict, cluster: pm.Cluster) -> dict:
    res = {lay: pm.step_time(p, cluster) for lay, p in probs.items()}
    base = res["3d"]["total"]
    for lay, r in res.items():
        r["vs_3d"] = r["total"] / base
    return res


def ratios(res: dict) -> dict:
    return {f"{lay}/3d": (res[lay]["vs_3d"] if lay in res else None) for lay in ("1d", "2d", "2.5d")}


def sensitivity(probs: dict, base: pm.Cluster) -> list:
    """A few cluster settings around the baseline, and the ratios each gives."""
    settings = [
        ("baseline", {}),
        ("NVLink ring edge 25 GB/s (1 link)", dict(intra_bw=25e9)),
        ("NVLink ring edge 150 GB/s (all 6 links)", dict(intra_bw=150e9)),
        ("InfiniBand 25 GB/s per node (dual rail)", dict(nic_bw=25e9)),
        ("InfiniBand 100 GB/s per node (4 x HDR)", dict(nic_bw=100e9)),
        ("NIC shared by all 4 GPUs on every inter-node axis", dict(nic_sharing="all")),
        ("alpha x10 (30 us / 60 us)", dict(alpha_intra=30e-6, alpha_inter=60e-6)),
        ("alpha 0 (bandwidth only)", dict(alpha_intra=0.0, alpha_inter=0.0)),
        ("GPU 15.7 TFLOP/s (fp32 peak)", dict(flops=15.7e12)),
        ("GPU 125 TFLOP/s (fp16 tensor peak)", dict(flops=125e12)),
        ("GPU 1000 TFLOP/s (communication dominates)", dict(flops=1e15)),
        ("everything in one node (NVLink for all axes)", dict(gpus_per_node=64)),
    ]
    out = []
    for label, kw in settings:
        res = project(probs, base.with_(**kw))
        out.append(dict(setting=label, changes={k: v for k, v in kw.items()}, ratios=ratios(res),
                        step_3d=res["3d"]["total"], comm_share_3d=res["3d"]["comm"] / res["3d"]["total"]))
    return out


def size_sweep(args, cluster: pm.Cluster) -> list:
    """Ratios at the baseline cluster for a few model/batch sizes around the
    default: they depend on tokens per step relative to the hidden size."""
    out = []
    for h, T, B in [(4096, 1024, 16), (8192, 512, 16), (8192, 1024, 16), (8192, 2048, 16), (8192, 1024, 64),
                    (12288, 2048, 16), (16384, 2048, 16)]:
        cfg = ModelConfig(vocab_size=args.vocab_size, n_ctx=T, n_layer=args.n_layer, n_head=args.n_head, n_embd=h)
        try:
            probs, _ = problems(cfg, B, args.world, args.depth)
        except ValueError as err:
            out.append(dict(n_embd=h, seq_len=T, batch=B, error=str(err)))
            continue
        res = project(probs, cluster)
        out.append(dict(n_embd=h, seq_len=T, batch=B, tokens=B * T, ratios=ratios(res),
                        comm_share_3d=res["3d"]["comm"] / res["3d"]["total"],
                        mem_gb={lay: pm.memory(p, cluster)["total_bytes"] / 1e9 for lay, p in probs.items()}))
    return out


# --------------------------------------------------------------------------- text output


def _show(key: str, val) -> str:
    if key == "flops":
        return f"{val / 1e12:g} TFLOP/s"
    if key.endswith("bw"):
        return f"{val / 1e9:g} GB/s"
    if key.startswith("alpha"):
        return f"{val * 1e6:g} us"
    return f"{val} B" if key == "bytes_per_elem" else str(val)


def _x(ratio) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _gb(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:9.1f}"


def report(args, cfg, cluster, probs, skipped, res, sens, sizes) -> str:
    L = []
    L.append(f"Projected step time, {args.world} ranks (dp 1), {cluster.name}")
    L.append(f"model: GPT-2, n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, n_head {cfg.n_head}, seq_len {cfg.n_ctx}, "
             f"vocab {cfg.vocab_size}, batch {args.batch_size} sequences ({args.batch_size * cfg.n_ctx} tokens); "
             f"{cfg.n_params() / 1e9:.2f}B parameters")
    L.append(f"2.5d depth {args.depth}; FLOPs per rank {pm.flops_per_rank(probs['3d']) / 1e12:.2f} TFLOP per step "
             "(6 N P_nonembedding + 6 N V h + 12 L N T h, divided by tp)")
    L.append("")
    L.append("parameters:")
    for key, what, why in SOURCES:
        val = getattr(cluster, key)
        shown = _show(key, val)
        if val != getattr(DEFAULTS, key):
            why = f"(set by option; default {_show(key, getattr(DEFAULTS, key))}) " + why
        wrapped = textwrap.wrap(why, 96)
        L.append(f"  {what:<22} {shown:>12}  {wrapped[0]}")
        L += [" " * 39 + line for line in wrapped[1:]]
    L.append(f"  {'placement':<22} {'':>12}  {cluster.gpus_per_node} consecutive world ranks per node; tp "
             f"innermost; NIC sharing model '{cluster.nic_sharing}'")
    L.append("")
    L.append(f"  {'layout':<6} {'compute ms':>10} {'comm intra':>10} {'comm inter':>10} {'step ms':>9} "
             f"{'x 3d':>6} {'paper':>6} {'memory/rank':>12}")
    for lay in pm.LAYOUTS:
        if lay not in res:
            L.append(f"  {lay:<6} n/a: {skipped[lay]}")
            continue
        r = res[lay]
        paper = PAPER.get(f"{lay}/3d")
        mem = pm.memory(probs[lay], cluster)["total_bytes"] / 1e9
        L.append(f"  {lay:<6} {_ms(r['compute']):>10} {_ms(r['comm_intra']):>10} {_ms(r['comm_inter']):>10} "
                 f"{_ms(r['total']):>9} {r['vs_3d']:>5.2f}x {(f'{paper:.2f}x' if paper else '-'):>6} "
                 f"{mem:>9.1f} GB")
    L.append("  (x 3d: step time relative to 3d, i.e. 3-D's projected speedup; paper: Bian et al.'s measured speedup)")
    L.append("")
    L.append("communication by axis (elements and messages per rank per step from mpicube.analysis.costmodel):")
    L.append(f"  {'layout':<6} {'axis':<10} {'ranks':>5} {'nodes':>5} {'link':>6} {'GB/s':>7} {'G elems':>9} "
             f"{'msgs':>7} {'ms':>9}")
    for lay in res:
        for axis, a in sorted(res[lay]["axes"].items(), key=lambda kv: -kv[1]["seconds"]):
            L.append(f"  {lay:<6} {axis:<10} {a['ranks']:>5} {a['nodes']:>5} {a['link']:>6} {a['bw'] / 1e9:>7.2f} "
                     f"{a['elems'] / 1e9:>9.3f} {a['msgs']:>7} {_ms(a['seconds'])}")
    if not sens:
        return "\n".join(L)
    L.append("")
    L.append("sensitivity (step time ratios; > 1 means 3-D is faster, as the paper found):")
    L.append(f"  {'setting':<50} {'1d/3d':>6} {'2d/3d':>6} {'2.5d/3d':>7} {'3d comm':>8}  paper's direction")
    for s in sens:
        r = s["ratios"]
        known = [r[k] for k in ("1d/3d", "2d/3d") if r[k] is not None]
        holds = "holds" if all(x > 1 for x in known) else "does NOT hold"
        L.append(f"  {s['setting']:<50} {_x(r['1d/3d']):>6} {_x(r['2d/3d']):>6} {_x(r['2.5d/3d']):>7} "
                 f"{s['comm_share_3d']:>7.0%}  {holds}")
    L.append(f"  {'paper (measured, 64 V100)':<50} {PAPER['1d/3d']:>6.2f} {PAPER['2d/3d']:>6.2f} {'-':>7}")
    L.append("")
    L.append("problem size (baseline cluster; 1d and 3d memory per rank in GB):")
    L.append(f"  {'n_embd':>6} {'seq':>5} {'batch':>5} {'1d/3d':>6} {'2d/3d':>6} {'2.5d/3d':>7} {'3d comm':>8} "
             f"{'mem 1d':>7} {'mem 3d':>7}")
    for s in sizes:
        if "error" in s:
            L.append(f"  {s['n_embd']:>6} {s['seq_len']:>5} {s['batch']:>5}  {s['error']}")
            continue
        r = s["ratios"]
        L.append(f"  {s['n_embd']:>6} {s['seq_len']:>5} {s['batch']:>5} {_x(r['1d/3d']):>6} {_x(r['2d/3d']):>6} "
                 f"{_x(r['2.5d/3d']):>7} {s['comm_share_3d']:>7.0%} {_gb(s['mem_gb'].get('1d')):>7} "
                 f"{_gb(s['mem_gb']['3d']):>7}")
    return "\n".join(L)


def to_json(args, cfg, cluster, probs, skipped, res, sens, sizes) -> dict:
    layouts = {}
    for lay, r in res.items():
        layouts[lay] = dict(compute_s=r["compute"], comm_s=r["comm"], comm_intra_s=r["comm_intra"],
                            comm_inter_s=r["comm_inter"], step_s=r["total"], vs_3d=r["vs_3d"],
                            flops_per_rank=pm.flops_per_rank(probs[lay]), memory_elems=pm.memory(probs[lay]),
                            depth=probs[lay].depth, axes=r["axes"])
    return dict(world=args.world, dp=1, model=dict(cfg.to_dict(), batch_size=args.batch_size),
                cluster=cluster.describe(), sources={k: why for k, _, why in SOURCES}, layouts=layouts,
                ratios=ratios(res), paper=PAPER, not_possible=skipped, sensitivity=sens, sizes=sizes)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world", type=int, default=64, help="ranks (GPUs), all tensor-parallel")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=8192)
    ap.add_argument("--n-head", type=int, default=64, help="divisible by 64 so that 1-D can split heads 64 ways")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16, help="divisible by 16 (3-D: q^2; 2.5-D: d q)")
    ap.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's vocabulary")
    ap.add_argument("--depth", type=int, default=None, help="2.5-D depth [default: q with world = q^3]")
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--flops", type=float, default=39e12, help="sustained FLOP/s per GPU")
    ap.add_argument("--intra-bw", type=float, default=50e9, help="B/s per direction on a ring edge inside a node")
    ap.add_argument("--nic-bw", type=float, default=12.5e9, help="B/s per direction per node (InfiniBand)")
    ap.add_argument("--alpha-intra", type=float, default=3e-6, help="s per message inside a node")
    ap.add_argument("--alpha-inter", type=float, default=6e-6, help="s per message between nodes")
    ap.add_argument("--bytes", type=int, default=2, help="bytes per element")
    ap.add_argument("--nic-sharing", choices=("ring", "all"), default="ring",
                    help="ring: rings leaving a node share its NIC; all: every GPU gets NIC/gpus_per_node")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the sensitivity and problem-size sweeps")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    if args.depth is None:
        args.depth = comparison_depth(args.world)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = ModelConfig(vocab_size=args.vocab_size, n_ctx=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd)
    cluster = default_cluster(args)
    try:
        probs, skipped = problems(cfg, args.batch_size, args.world, args.depth)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    res = project(probs, cluster)
    sens = [] if args.no_sweeps else sensitivity(probs, cluster)
    sizes = [] if args.no_sweeps else size_sweep(args, cluster)
    if args.json:
        print(json.dumps(to_json(args, cfg, cluster, probs, skipped, res, sens, sizes)))
    else:
        print(report(args, cfg, cluster, probs, skipped, res, sens, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
