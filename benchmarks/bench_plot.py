"""docs/figures/bench.png (issue 47): ``make bench``'s results as a figure, read from its ``--json`` output.

Left: step time relative to DDP (the median over steps of the paired per-step ratios, as the table's "vs DDP")
against model size, for torch FSDP1, FSDP2, accel_flatshard (``ours``) and the no-communication bound.  Right: the
bytes our engine sends per step and rank (ShardGroup's counters, the table's "sent MiB/step/rank"; the other
engines' traffic is not counted by the bench).

    python benchmarks/bench_plot.py bench.json docs/figures/bench.png [--title ...]
    python benchmarks/bench_plot.py --link bench_link.json docs/figures/link.png   # make bench-link's crossover

``--link``: ``benchmarks/link_bench.py --json``'s rows as the crossover chart: one panel per machines x ranks (and
accumulation), step time against link rate for each engine (log-log; "unshaped" drawn at the right end), the bound
of our exact engine dashed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple

ENGINES = (("fsdp1", "torch FSDP1"), ("fsdp2", "torch FSDP2"), ("ours", "accel_flatshard"),
           ("nocomm", "no-communication bound"))


def ratios(results: List[Dict[str, Any]]) -> Dict[str, List[Tuple[float, str, float]]]:
    """``{engine: [(parameters, row, step time vs DDP), ...]}`` sorted by size, for the engines of
    :data:`ENGINES` that ran next to DDP."""
    out: Dict[str, List[Tuple[float, str, float]]] = {e: [] for e, _ in ENGINES}
    for res in results:
        idx = {e: i for i, e in enumerate(res["engines"])}
        if "ddp" not in idx:
            continue
        ddp = res["times"][idx["ddp"]]
        for e, _ in ENGINES:
            if e in idx:
                out[e].append((res["params"], res["row"],
                               statistics.median(a / b for a, b in zip(res["times"][idx[e]], ddp))))
    return {e: sorted(v) for e, v in out.items() if v}


def sent(results: List[Dict[str, Any]]) -> List[Tuple[float, str, float]]:
    """``[(parameters, row, MiB sent per step and rank by ours), ...]`` sorted by size."""
    return sorted((res["params"], res["row"], res["sent_mb"][res["engines"].index("ours")])
                  for res in results if "ours" in res["engines"])


def plot_bench(data: Dict[str, Any], out: str, title: Optional[str] = None) -> None:
    """Draw ``data`` (bench.py ``--json``: ``{"argv", "results", "table"}``) to the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    by_engine, traffic = ratios(results), sent(results)
    if not by_engine:
        raise ValueError("no row ran DDP next to other engines: nothing to draw relative to DDP")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6), dpi=90, gridspec_kw={"width_ratios": (3, 2)})
    styles = {"fsdp1": ("#dd8452", "s"), "fsdp2": ("#c44e52", "^"), "ours": ("#4c72b0", "o"),
              "nocomm": ("0.5", "v")}
    for e, label in ENGINES:
        if e in by_engine:
            points = by_engine[e]
            colour, marker = styles[e]
            left.plot([p / 1e6 for p, _, _ in points], [r for _, _, r in points], marker=marker, color=colour,
                      label=label, linestyle="--" if e == "nocomm" else "-")
    left.axhline(1.0, color="black", linewidth=0.8, label="DDP")
    lowest = min(r for points in by_engine.values() for _, _, r in points)
    left.set_ylim(bottom=min(0.9, lowest - 0.05))
    left.set_xscale("log")
    sizes = sorted({(p, row) for points in by_engine.values() for p, row, _ in points})
    left.set_xticks([p / 1e6 for p, _ in sizes], [f"{row}\n{p / 1e6:.1f} M" for p, row in sizes], fontsize=7)
    left.minorticks_off()
    left.set_xlabel("model (parameters)")
    left.set_ylabel("step time / DDP's (median of paired steps)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(0, -0.2), ncol=3)
    if traffic:
        right.bar(range(len(traffic)), [mb for _, _, mb in traffic], color="#4c72b0")
        right.set_xticks(range(len(traffic)), [f"{row}\n{p / 1e6:.1f} M" for p, row, _ in traffic], fontsize=7)
        for i, (_, _, mb) in enumerate(traffic):
            right.annotate(f"{mb:,.1f}", (i, mb), ha="center", va="bottom", fontsize=7)
    right.set_ylabel("MiB sent per step and rank (accel_flatshard)")
    right.set_title("bytes on the wire (ShardGroup's counters)", fontsize=8)
    fig.suptitle(textwrap.fill(title or "make bench: " + " ".join(data.get("argv", [])[1:]), 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def link_series(rows: List[Dict[str, Any]]) -> Dict[Tuple[str, int], Dict[str, List[Tuple[float, float]]]]:
    """``{(topology, accumulate): {engine: [(rate Gbit/s, median step s), ...]}}``, rates ascending, the unshaped
    phase as rate ``inf``."""
    out: Dict[Tuple[str, int], Dict[str, List[Tuple[float, float]]]] = {}
    for r in rows:
        rate = r["rate_gbit"] or float("inf")
        out.setdefault((r["topology"], r["accumulate"]), {}).setdefault(r["engine"], []).append((rate, r["median_s"]))
    return {k: {e: sorted(v) for e, v in panel.items()} for k, panel in out.items()}


def plot_link(data: Dict[str, Any], out: str, title: Optional[str] = None) -> None:
    """Draw ``data`` (link_bench.py ``--json``: ``{"argv", "head", "rows"}``) to the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = link_series(data["rows"])
    if not panels:
        raise ValueError("no rows to draw")
    finite = sorted({r for panel in panels.values() for pts in panel.values() for r, _ in pts if r != float("inf")})
    right = (finite[-1] * 4) if finite else 1.0  # where "unshaped" is drawn
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), dpi=90, squeeze=False)
    engines = sorted({e for panel in panels.values() for e in panel} - {"ddp", "ours"})
    palette = plt.get_cmap("tab20").colors
    colour = {"ddp": "black", "ours": "#c44e52", **{e: palette[i % len(palette)] for i, e in enumerate(engines)}}
    for ax, ((topology, k), panel) in zip(axes[0], sorted(panels.items())):
        for e, pts in sorted(panel.items()):
            xs = [right if r == float("inf") else r for r, _ in pts]
            ax.plot(xs, [t * 1e3 for _, t in pts], marker="o", markersize=3, label=e,
                    linewidth=2.2 if e in ("ddp", "ours") else 1.1, color=colour[e])
        bound = sorted((right if r["rate_gbit"] == 0 else r["rate_gbit"], r["bound_s"]) for r in data["rows"]
                       if (r["topology"], r["accumulate"], r["engine"]) == (topology, k, "ours"))
        if bound:
            ax.plot([x for x, _ in bound], [b * 1e3 for _, b in bound], linestyle="--", color="0.4",
                    label="bound of ours exact: max(compute, bytes / rate)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(finite + [right], [f"{r:g}" for r in finite] + ["unshaped"], fontsize=7)
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.set_xlabel("link rate between the machines (Gbit/s)")
        ax.set_ylabel("step time (ms, median)")
        ax.set_title(f"{topology} (machines x ranks), {k} micro-batch{'es' if k > 1 else ''} per step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, frameon=False)
    fig.suptitle(textwrap.fill(title or data.get("head", "make bench-link"), 75 * len(panels)), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", help="bench.py --json output (link_bench.py's with --link)")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--link", action="store_true", help="the json is link_bench.py's: draw the crossover chart")
    args = p.parse_args(argv)
    with open(args.json) as f:
        (plot_link if args.link else plot_bench)(json.load(f), args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
