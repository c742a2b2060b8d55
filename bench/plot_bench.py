#!/usr/bin/env python3
"""Plots a duet-bench JSON report (loadgen/report.h) to a PNG.

    python3 bench/plot_bench.py REPORT.json OUT.png

Top row: the CDFs of TTFT, TPOT and E2E over the ok requests, one curve per
run. With several runs (a sweep), a second row: TTFT and TPOT p99 against
the request rate (or the concurrency), and throughput and goodput against it.
Exits with status 3 and a one-line message when matplotlib is missing.
"""

import json
import math
import sys


def per_request(run):
    """(ttfts, tpots, e2es) in ms over the run's ok requests."""
    ttfts, tpots, e2es = [], [], []
    for r in run["requests"]:
        if not r["ok"]:
            continue
        e2es.append((r["finished_s"] - r["sent_s"]) * 1e3)
        if r["first_token_s"] is None:
            continue
        ttfts.append((r["first_token_s"] - r["sent_s"]) * 1e3)
        tokens = r["received_tokens"] or len(r["token_times_s"])
        if tokens >= 2:
            tpots.append((r["finished_s"] - r["first_token_s"]) / (tokens - 1) * 1e3)
    return ttfts, tpots, e2es


def sweep_axis(runs):
    """(x label, x values) of a sweep: rates when every run has one, else concurrencies."""
    rates = [r["rate"] for r in runs]
    if all(rate is not None for rate in rates):
        # "inf" (everything at once) is drawn at the achieved request rate.
        return "request rate (req/s)", [
            r["summary"]["request_rate"] if rate == "inf" else rate for r, rate in zip(runs, rates)]
    return "concurrency", [r["concurrency"] or 0 for r in runs]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py REPORT.json OUT.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench.py: matplotlib is not installed; `pip install matplotlib` "
              "(or set DUET_PYTHON to a Python that has it)", file=sys.stderr)
        sys.exit(3)

    with open(sys.argv[1]) as f:
        report = json.load(f)
    runs = report["runs"]
    sweep = len(runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8 if sweep else 4.2), dpi=110,
                             squeeze=False)
    slo = report.get("slo", {})
    for column, (name, slo_ms) in enumerate([("TTFT", slo.get("ttft_ms")),
                                             ("TPOT", slo.get("tpot_ms")), ("E2E", None)]):
        ax = axes[0][column]
        for run in runs:
            values = sorted(per_request(run)[column])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                        where="post", label=run["label"])
        if slo_ms:
            ax.axvline(slo_ms, color="grey", linestyle=":", label=f"SLO {slo_ms:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of ok requests")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")

    if sweep:
        xlabel, xs = sweep_axis(runs)
        for column, key in enumerate(["ttft_ms", "tpot_ms"]):
            ax = axes[1][column]
            for stat, style in (("p50", "o--"), ("p99", "o-")):
                ax.plot(xs, [r["summary"][key][stat] for r in runs], style, label=stat)
            if slo.get(key):
                ax.axhline(slo[key], color="grey", linestyle=":", label="SLO")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{key[:4].upper()} (ms)")
            ax.set_title(f"{key[:4].upper()} against load")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        ax = axes[1][2]
        ax.plot(xs, [r["summary"]["request_rate"] for r in runs], "o-", label="throughput")
        ax.plot(xs, [r["summary"]["goodput"] for r in runs], "s-", label="goodput")
        if xlabel.startswith("request rate") and all(math.isfinite(x) for x in xs):
            ax.plot(xs, xs, color="grey", linestyle=":", label="offered")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("requests/s")
        ax.set_title("throughput and goodput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")

    config = report.get("config", {})
    fig.suptitle(f"duet-bench: {config.get('server', '')}, in {config.get('input_len', '')} / "
                 f"out {config.get('output_len', '')} tokens")
    fig.tight_layout()
    fig.savefig(sys.argv[2])


if __name__ == "__main__":
    main()
