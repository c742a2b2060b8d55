#!/usr/bin/env python3
"""Plots a `duet-sim plan` JSON report to a PNG: goodput per GPU against the
cluster size, for the best disaggregated and the best colocated layout.

    python3 sim/plot_plan.py PLAN.json OUT.png

Exits with status 3 and a one-line message when matplotlib is missing.
"""

import json
import sys


def best(layouts, mode):
    """The first (best-ranked) layout of a mode, or None."""
    for layout in layouts:
        if layout["mode"] == mode:
            return layout
    return None


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_plan.py: matplotlib is not installed; no plot", file=sys.stderr)
        return 3
    report = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(9.5, 5))
    for mode, style in (("disaggregated", "o-"), ("colocated", "s--")):
        xs, ys, labels = [], [], []
        for size in report["sizes"]:
            layout = best(size["layouts"], mode)
            if layout is None:
                continue
            xs.append(size["gpus"])
            ys.append(layout["goodput_per_gpu"])
            labels.append(layout["layout"])
        if not xs:
            continue
        ax.plot(xs, ys, style, label=f"best {mode}")
        # Above and below in turn: long labels of neighbouring sizes overlap.
        for i, (x, y, label) in enumerate(zip(xs, ys, labels)):
            ax.annotate(label, (x, y), textcoords="offset points",
                        xytext=(0, 6 if i % 2 == 0 else -11), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput per GPU (req/s)")
    slo = report["slo"]
    ax.set_title(f"{report['profile']['model']} on {report['profile']['device']}: "
                 f"TTFT {slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms, "
                 f"{report['attainment'] * 100:.0f}% attainment", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
