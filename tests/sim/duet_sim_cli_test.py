#!/usr/bin/env python3
"""duet-sim as its users run it: a roofline profile from `duet profile`, a
trace through a disaggregated cluster twice (the same report both times, in
duet-bench's layout), the shifting trace with the rebalancer on, a small
plan, and bad input refused with a message.

    duet_sim_cli_test.py DUET DUET_SIM TRACE
"""

import json
import pathlib
import subprocess
import sys
import tempfile


def run(*args, ok=True):
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if ok and result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(args)}\n{result.stderr}")
    return result


def without_wall_time(report):
    for sim in report["simulation"]:
        sim.pop("wall_s")
    return report


def main():
    duet, sim, trace = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        profile = tmp / "h100.json"
        run(duet, "profile", "--roofline", "--hardware", "h100", "--model-shape", "llama-3-8b",
            "--tp", "1,2", "--out", str(profile))

        reports = []
        for i in range(2):
            out = tmp / f"run{i}.json"
            result = run(sim, "--profile", str(profile), "--cluster", "1P+2D@tp2", "--trace", trace,
                         "--time-scale", "20", "--slo", "ttft=1000,tpot=50", "--json", str(out))
            assert "ok of 80" in result.stdout, result.stdout
            reports.append(json.loads(out.read_text()))
        first, second = (without_wall_time(r) for r in reports)
        assert first == second, "the same trace gave two reports"
        assert first["tool"] == "duet-sim"
        summary = first["runs"][0]["summary"]
        assert summary["n_ok"] == 80 and summary["ttft_ms"]["p50"] > 0, summary
        roles = [i["role"] for i in first["simulation"][0]["instances"]]
        assert roles == ["prefill", "decode", "decode"], roles

        # Prompts crowd the one prefill instance: the rebalancer (the rule
        # `duet serve --rebalance auto` runs) turns a decode instance to prefill.
        shift = pathlib.Path(trace).parent / "shift.csv"
        moved = tmp / "moved.json"
        result = run(sim, "--profile", str(profile), "--cluster", "1P+2D", "--trace", str(shift),
                     "-n", "1000", "--time-scale", "200", "--slo", "ttft=200,tpot=10",
                     "--rebalance", "auto", "--json", str(moved))
        assert "role change" in result.stdout and "decode -> prefill" in result.stdout, result.stdout
        simulation = json.loads(moved.read_text())["simulation"][0]
        changes = simulation["role_changes"]
        assert [(c["from"], c["to"]) for c in changes] == [("decode", "prefill")], changes
        roles = sorted(i["role"] for i in simulation["instances"])
        assert roles == ["decode", "prefill", "prefill"], roles

        plan = tmp / "plan.json"
        result = run(sim, "plan", "--profile", str(profile), "--slo", "ttft=1000,tpot=50",
                     "--gpus", "4", "--tp", "1", "--span", "5", "--min-requests", "100",
                     "--requests-per-instance", "20", "--json", str(plan))
        assert "| 4 |" in result.stdout, result.stdout
        layouts = json.loads(plan.read_text())["sizes"][0]["layouts"]
        assert layouts[0]["goodput_per_gpu"] > 0, layouts[0]

        for bad, words in ((["--cluster", "3X"], "is not P, D or C"),
                           (["--cluster", "1P@tp4+1D"], "tp"),
                           (["--transfer", "carrier-pigeon", "--cluster", "1P+1D"], "carrier-pigeon"),
                           (["--rebalance", "auto", "--cluster", "1P+2D"], "needs --slo"),
                           (["--rebalance", "auto", "--cluster", "2C", "--slo", "ttft=100"],
                            "needs a disaggregated cluster")):
            result = run(sim, "--profile", str(profile), "--trace", trace, *bad, ok=False)
            assert result.returncode == 2 and words in result.stderr, (bad, result.stderr)
    print("duet-sim CLI: ok")


if __name__ == "__main__":
    main()
