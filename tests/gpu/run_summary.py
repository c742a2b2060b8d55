#!/usr/bin/env python3
"""The GPU run's summary, one screen: what tests/gpu/run.sh prints at the end.

    run_summary.py WORK_DIR [--budget SECONDS] [--elapsed SECONDS]

Reads what run.sh left in WORK_DIR: steps.tsv (step, exit code, seconds,
status, note), probe.env (KEY=VALUE), bench.json and bench_8b.json (as
duet-cuda-bench writes them), and the IPC checks' logs. Prints the machine,
a row per step, and the key figures as fractions of the rooflines the GPU
measured, beside the goals the next step of the CUDA work aims at; writes the
same as WORK_DIR/summary.json. Standard library only.
"""
import argparse
import json
import os
import re

NOTE_WIDTH = 72
LINE_WIDTH = 120  # one screen: no line wraps
GOALS = {"decode_b1": 0.70, "prefill": 0.50, "ipc": 0.70}  # fractions of a roofline
IPC_LINE = re.compile(r"same (\d+) payloads of ([\d.]+) MiB ([\d.]+) GB/s; IPC ([\d.]+) GB/s")


def read_steps(work):
    rows = []
    path = os.path.join(work, "steps.tsv")
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines[1:]:
        fields = line.split("\t") + [""] * 5
        rows.append(dict(zip(("step", "exit", "seconds", "status", "note"), fields[:5])))
    return rows


def read_env(work):
    env = {}
    path = os.path.join(work, "probe.env")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition("=")
                env[key] = value
    return env


def read_json(work, name):
    try:
        with open(os.path.join(work, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ipc_figures(work, log):
    """(IPC GB/s, same-size copy GB/s, payload MiB) from an IPC check's log, or None."""
    try:
        with open(os.path.join(work, log), encoding="utf-8", errors="replace") as f:
            match = IPC_LINE.search(f.read())
    except OSError:
        return None
    if not match:
        return None
    return float(match.group(4)), float(match.group(3)), float(match.group(2))


def bench_figures(bench):
    """Key figures of one duet-cuda-bench JSON, as a dict (empty without one)."""
    if not bench:
        return {}
    out = {"copy_gbps": bench.get("copy_gbps"), "gemm_tflops": bench.get("gemm_tflops")}
    for row in bench.get("gemv", []):
        if row.get("type") == "Q4_0" and row.get("n_x") == 1:
            out["gemv_q4_0_b1_of_copy"] = row.get("ratio_to_copy")
    decode = bench.get("model_decode", {})
    for key in ("b1", "b64"):
        graphs = decode.get(key, {}).get("graphs", {})
        if graphs:
            out[f"decode_{key}_tokens_per_s"] = graphs.get("tokens_per_s")
            out[f"decode_{key}_of_copy"] = graphs.get("ratio_to_copy")
    prefill = bench.get("model_prefill", {})
    if prefill:
        out["prefill_tokens"] = prefill.get("prompt_tokens")
        out["prefill_tokens_per_s"] = prefill.get("tokens_per_s")
        out["prefill_of_gemm"] = prefill.get("ratio_to_gemm")
    out["model"] = bench.get("model", {}).get("name")
    return out


def clip(line, width):
    return line if len(line) <= width else line[:width - 3] + "..."


def number(value, digits=0):
    return "?" if value is None else f"{value:,.{digits}f}"


def goal(value, key):
    if value is None:
        return ""
    return f"  [goal >= {GOALS[key]:.2f}: {'met' if value >= GOALS[key] else 'not met'}]"


def figure_lines(tiny, big, ipc):
    lines = []
    roof = big or tiny
    if roof:
        lines.append(f"  rooflines: device copy {number(roof.get('copy_gbps'))} GB/s (read + write), "
                     f"cuBLAS F16 GEMM {number(roof.get('gemm_tflops'))} TFLOP/s")
    if tiny.get("gemv_q4_0_b1_of_copy") is not None:
        lines.append(f"  synthetic 8B layer, Q4_0 GEMV batch 1: "
                     f"{tiny['gemv_q4_0_b1_of_copy']:.2f} of copy")
    if big:
        name = big.get("model") or "synthetic model"
        for key in ("b1", "b64"):
            of_copy = big.get(f"decode_{key}_of_copy")
            if of_copy is None:
                continue
            lines.append(f"  {name}, decode batch {key[1:]}: "
                         f"{number(big.get(f'decode_{key}_tokens_per_s'))} tokens/s, "
                         f"{of_copy:.2f} of copy" + (goal(of_copy, "decode_b1") if key == "b1" else ""))
        if big.get("prefill_of_gemm") is not None:
            lines.append(f"  {name}, prefill of {big.get('prefill_tokens')} tokens: "
                         f"{number(big.get('prefill_tokens_per_s'))} tokens/s, "
                         f"{big['prefill_of_gemm']:.2f} of GEMM" + goal(big["prefill_of_gemm"], "prefill"))
    if ipc:
        rate, copy, payload = ipc
        lines.append(f"  CUDA IPC KV payloads of {payload:.1f} MiB: {number(rate, 1)} GB/s, "
                     f"{rate / copy:.2f} of a device copy of the same size" + goal(rate / copy, "ipc"))
    return lines


def machine_lines(env):
    gpu = env.get("gpu", "")
    count = int(env.get("gpu_count") or 0)
    lines = [f"GPU     {gpu if count else 'none'}" + (f" ({count} in all)" if count > 1 else "")]
    tools = (f"Tools   nvcc {env.get('nvcc_version') or 'absent'}, driver's CUDA "
             f"{env.get('driver_cuda') or '?'}, NCCL {env.get('nccl_version') or '?'} "
             f"({env.get('nccl_where', '?')}; header: {env.get('nccl_header', '?')})")
    lines.append(tools)
    lines.append(f"Host    {env.get('cores', '?')} cores, {env.get('memory_gib', '?')} GiB, "
                 f"{env.get('disk_free_gib', '?')} GiB free, cmake {env.get('cmake') or 'absent'}, "
                 f"ninja {env.get('ninja') or 'absent'}, python {env.get('python3') or 'absent'}")
    lines.append("Model   " + (env.get("default_model") or
                               "default model absent: its cases skip (the checks use the fixtures)"))
    nvcc, driver = env.get("nvcc_version", ""), env.get("driver_cuda", "")
    if nvcc and driver and tuple(map(int, nvcc.split(".")[:2])) > tuple(map(int, driver.split(".")[:2])):
        lines.append(f"WARNING nvcc {nvcc} is newer than the driver's CUDA {driver}: "
                     "binaries may refuse to start")
    if "Exclusive" in gpu or "Prohibited" in gpu:
        lines.append("WARNING the compute mode lets no two processes share the GPU: ipc_kv cannot pass")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--budget", type=int, default=600)
    ap.add_argument("--elapsed", type=int, help="seconds the run has taken so far")
    args = ap.parse_args()

    steps = read_steps(args.work)
    env = read_env(args.work)
    tiny = bench_figures(read_json(args.work, "bench.json"))
    big = bench_figures(read_json(args.work, "bench_8b.json"))
    ipc = ipc_figures(args.work, "ipc_kv_8b.log") or ipc_figures(args.work, "ipc_kv.log")

    total = args.elapsed
    if total is None:
        total = sum(float(r["seconds"]) for r in steps if re.fullmatch(r"[\d.]+", r["seconds"]))
    bad = [r["step"] for r in steps if r["status"] not in ("passed", "skipped", "done")]
    verdict = f"{len(bad)} step(s) not passed: {', '.join(bad)}" if bad else "no step failed"
    lines = [f"Duet GPU run: {len(steps)} steps in {total:.0f} s (budget {args.budget} s); "
             + verdict]
    lines += machine_lines(env)
    lines.append("")
    lines.append(f"{'step':<11}{'exit':>5}{'seconds':>9}  {'status':<10} note")
    for r in steps:
        lines.append(f"{r['step']:<11}{r['exit']:>5}{r['seconds']:>9}  {r['status']:<10} "
                     + clip(r["note"], NOTE_WIDTH))
    figures = figure_lines(tiny, big, ipc)
    if figures:
        lines.append("")
        lines.append("Figures (fractions of what this GPU measured):")
        lines += figures
    print("\n".join(clip(line, LINE_WIDTH) for line in lines))

    with open(os.path.join(args.work, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": steps, "probe": env, "bench": tiny, "bench_8b": big,
                   "ipc": None if not ipc else {"gbps": ipc[0], "copy_gbps": ipc[1],
                                                 "payload_mib": ipc[2]},
                   "goals": GOALS, "not_passed": bad}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
