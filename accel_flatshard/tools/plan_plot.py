"""``accel-flatshard plan --plot FILE``: a rank's memory over the planned step, by kind, as a PNG (matplotlib, the
``docs`` extra, imported only here and only when a plot is asked for).

The curve is the planner's own measurement (``run.predict(curve=True)``: what is held after every op of the last
fake step, split as the plan's table splits it); the peak is marked with where it falls.  ``--measured FILE``
draws a real run beside it: a JSON with ``peak_bytes`` (one per rank), optionally ``curve`` (per rank, the bytes
in use after every op of the measured step) and ``source`` (how it was measured), as
``tests/scripts/plan_measure.py --curve`` writes.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from ..plan import run

MIB = 2**20
_RANKS = ("black", "#1f77b4", "#2ca02c", "#d62728")
# the plan's kinds (run.PARTS), bottom to top: what persists first
_COLOURS = {"parameter shards": "#4c72b0", "gradient shards": "#dd8452", "optimizer state": "#55a868",
            "module buffers": "#8c8c8c", "gathered units": "#c44e52", "full gradients": "#e8a33d",
            "secondary shards": "#937860", "activations": "#8172b3", "optimizer step": "#da8bc3"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'accel_flatshard[docs]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_measured(path: str) -> Dict[str, Any]:
    """A measured run's JSON (``peak_bytes``: a list, one per rank; ``curve``: optional, a list of lists)."""
    with open(path) as f:
        measured = json.load(f)
    if not isinstance(measured.get("peak_bytes"), list):
        raise ValueError(f"--measured {path}: no 'peak_bytes' list (one peak per rank) in it")
    return measured


def plot_plan(planner: Any, cfg: Any, out: str, measured: Optional[Dict[str, Any]] = None,
              title: Optional[str] = None) -> run.Prediction:
    """Plot rank 0's planned memory over the step of ``cfg`` (a stack by kind, the peak marked, the phases shaded)
    to the PNG ``out``, with ``measured`` (see the module docstring) beside it; returns the prediction."""
    plt = _pyplot()
    pred = run.predict(planner, cfg, curve=True)
    if not pred.curve:
        raise ValueError("the planned step recorded no op (nothing to plot)")
    kinds = [k for k in run.PARTS if any(parts[k] for _, parts in pred.curve)]
    x = list(range(len(pred.curve)))
    curves, peaks = (measured or {}).get("curve") or [], (measured or {}).get("peak_bytes") or []
    top = max([pred.peak_bytes, *peaks, *(max(c) for c in curves if c)]) / MIB * 1.22
    if measured:
        fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=90, sharey=True,
                                        gridspec_kw={"width_ratios": (3, 2)})
        _plot_measured(right, curves, peaks, pred.peak_bytes)
        right.set_title(f"measured: {measured.get('source', 'the --measured run')}", fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(10.5, 4.6), dpi=90)
    _shade_phases(ax, [where for where, _ in pred.curve])
    ax.stackplot(x, [[parts[k] / MIB for _, parts in pred.curve] for k in kinds], labels=kinds,
                 colors=[_COLOURS[k] for k in kinds], alpha=0.9, linewidth=0)
    at = max(x, key=lambda i: sum(pred.curve[i][1].values()))
    ax.axvline(at, color="black", linewidth=0.8, linestyle=":")
    ax.annotate(f"planned peak {pred.peak_bytes / MIB:,.1f} MiB\n({pred.where})", (at, pred.peak_bytes / MIB),
                xytext=(8, -4), textcoords="offset points", fontsize=8, va="top")
    ax.set_xlim(0, len(x) - 1)
    ax.set_ylim(0, top)
    ax.set_xlabel("the plan: ops of the step (forward, backward, optimizer step), in order")
    ax.set_ylabel("MiB held by rank 0 (the fullest shard)")
    fig.suptitle(title or f"accel-flatshard plan: {planner.class_name}, {planner.numel / 1e6:,.2f} M parameters, "
                 f"{cfg.describe(planner.world_size)},\n{planner.world_size} ranks, {planner.device}", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.13), ncol=5, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return pred


def _plot_measured(ax: Any, curves: List[List[int]], peaks: List[int], planned: int) -> None:
    """The measured run: each rank's bytes in use over its step (if recorded) and its peak, the planned peak."""
    for rank, values in enumerate(curves):
        if values:
            ax.plot(range(len(values)), [v / MIB for v in values], linewidth=0.9, color=_RANKS[rank % len(_RANKS)],
                    label=f"rank {rank}")
    for rank, peak in enumerate(peaks):
        ax.axhline(peak / MIB, color=_RANKS[rank % len(_RANKS)], linewidth=0.7, linestyle="--",
                   label=f"measured peak, rank {rank}: {peak / MIB:,.1f} MiB")
    ax.axhline(planned / MIB, color="#8172b3", linewidth=1.2, linestyle=":",
               label=f"planned peak: {planned / MIB:,.1f} MiB")
    ax.set_xlabel("measured: ops of the real step, in order" if any(curves) else "measured")
    ax.legend(fontsize=7, loc="center right", frameon=False)
    ax.grid(alpha=0.3)


def _shade_phases(ax: Any, wheres: List[str]) -> None:
    """Shade the forward, backward and optimizer step, and name each unit where its stretch is wide enough."""
    spans, start = [], 0
    for i in range(1, len(wheres) + 1):
        if i == len(wheres) or wheres[i] != wheres[start]:
            spans.append((start, i, wheres[start]))
            start = i
    shade = {"forward": "#f2f2f2", "backward": "#e4e4e4", "optimizer": "#d0d0d0"}
    for a, b, where in spans:
        phase = where.split(" ", 1)[0]
        ax.axvspan(a, b, color=shade.get(phase, "white"), linewidth=0, zorder=0)
        if b - a > len(wheres) / 25:
            ax.text((a + b) / 2, 0.985, where.replace(" of ", "\n").replace(".", ".\n", 1) if b - a < len(wheres) / 8
                    else where.replace(" of ", "\n"), transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=5.5, color="0.3")
