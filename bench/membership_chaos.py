#!/usr/bin/env python3
"""Kill and stop instances of a serving cluster for minutes; count what is lost.

Starts `launch/local.sh 0 N --mode colocated` (replacements on; with
`--prefill P`, the disaggregated `launch/local.sh P N`), keeps
WORKERS clients sending completions (greedy and seeded, each prompt's text
known from single-process `duet generate`), and every PERIOD seconds picks
a live instance process at random and either SIGKILLs it or SIGSTOPs it for
STOP seconds (then SIGCONT: a joined member rejoins, a rank of the mpirun
job leaves). Afterwards it waits for the cluster to go idle and reports:
requests sent, failed, and whose text differed from `duet generate`; KV
blocks not free once idle (quarantined ones apart); re-runs; replacements
started; instances up at the end. Exit code 1 when a request failed or
differed, or a block leaked.

  python3 bench/membership_chaos.py [--minutes 5] [--period 20] [--instances 2] [--prefill 0]

Environment: DUET_BINARY (default build/tools/duet), DUET_MODEL (default the
setup's model), DUET_MPIRUN. Name the CPU beside any figure you quote.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first", "The best way to learn", "In the year 2050,"]


def generate(binary, model, body):
    command = [binary, "generate", "--model", model, "--prompt", body["prompt"],
               "-n", str(body["max_tokens"]), "--threads", "1", "--temp", str(body["temperature"]),
               "--ignore-eos"]
    if "seed" in body:
        command += ["--seed", str(body["seed"]), "--top-p", str(body["top_p"])]
    text = subprocess.run(command, capture_output=True, timeout=120, check=True).stdout.decode()
    return text[:-1] if text.endswith("\n") else text


def bodies(max_tokens):
    out = []
    for i, p in enumerate(PROMPTS):
        out.append({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        out.append({"prompt": p, "max_tokens": max_tokens, "temperature": 0.9, "seed": 7 + i,
                    "top_p": 0.95, "ignore_eos": True})
    return out


def metrics(url):
    samples = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
    return samples


def instance_pids(tag):
    """Live processes of the cluster's instances: ranks >= 1 of the job, and
    replacements (joined members), found by the tag in their environment."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if f"DUET_CHAOS_TAG={tag}".encode() not in env or b"serve" not in cmd:
            continue
        if not cmd[0].endswith(b"duet"):
            continue
        rank = next((e for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank == b"OMPI_COMM_WORLD_RANK=0":
            continue  # the coordinator
        pids.append(int(pid))
    return pids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--period", type=float, default=20.0)
    parser.add_argument("--stop", type=float, default=6.0, help="seconds a SIGSTOP lasts")
    parser.add_argument("--instances", type=int, default=2,
                        help="colocated instances, or with --prefill the decode ones")
    parser.add_argument("--prefill", type=int, default=0,
                        help="prefill instances: a disaggregated cluster (0: colocated)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    binary = os.environ.get("DUET_BINARY", os.path.join(ROOT, "build", "tools", "duet"))
    model = os.environ.get("DUET_MODEL",
                           os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    work = bodies(args.max_tokens)
    expected = {json.dumps(b, sort_keys=True): generate(binary, model, b) for b in work}

    tag = f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "DUET_SKIP_SETUP": "1", "DUET_SKIP_BUILD": "1", "DUET_BINARY": binary,
           "DUET_MODEL": model, "DUET_CHAOS_TAG": tag}
    layout = ([str(args.prefill), str(args.instances)] if args.prefill > 0 else
              ["0", str(args.instances), "--mode", "colocated"])
    launcher = subprocess.Popen(
        ["bash", os.path.join(ROOT, "launch", "local.sh"), *layout, "--kv-cache-mem", "64MiB",
         "--max-retries", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    log = []
    threading.Thread(target=lambda: [log.append(l.rstrip()) for l in launcher.stderr],
                     daemon=True).start()
    url = None
    for line in launcher.stdout:
        m = re.match(r"http listening on (\S+)", line.strip())
        if m:
            url = "http://" + m.group(1)
            break
    if url is None:
        print("\n".join(log[-40:]))
        return 2

    counts = {"sent": 0, "failed": 0, "differed": 0}
    failures = []
    lock = threading.Lock()
    done = threading.Event()

    def client(seed):
        rng = random.Random(seed)
        while not done.is_set():
            body = rng.choice(work)
            request = urllib.request.Request(url + "/v1/completions",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=300) as r:
                    text = json.loads(r.read())["choices"][0]["text"]
                ok, same = True, text == expected[json.dumps(body, sort_keys=True)]
            except Exception as e:  # noqa: BLE001 - every failure is counted
                ok, same = False, False
                with lock:
                    failures.append(str(e))
            with lock:
                counts["sent"] += 1
                counts["failed"] += 0 if ok else 1
                counts["differed"] += 1 if ok and not same else 0

    clients = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(args.workers)]
    for c in clients:
        c.start()
    rng = random.Random(1)
    events = []
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        time.sleep(args.period)
        pids = instance_pids(tag)
        if not pids:
            events.append("no instance process to hit")
            continue
        victim = rng.choice(pids)
        if rng.random() < 0.5:
            os.kill(victim, signal.SIGKILL)
            events.append(f"SIGKILL {victim}")
        else:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(args.stop)
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
            events.append(f"SIGSTOP {victim} for {args.stop:.0f} s")
        print(f"[{time.strftime('%H:%M:%S')}] {events[-1]}; so far {counts}", flush=True)
    done.set()
    for c in clients:
        c.join(300)
    time.sleep(3)
    m = metrics(url)
    total, free = m["duet_kv_blocks_total"], m["duet_kv_blocks_free"]
    quarantined = m.get("duet_kv_blocks_quarantined", 0)
    leaked = total - free - quarantined if m["duet_running_sequences"] == 0 else -1
    up = sum(v for k, v in m.items() if k.startswith("duet_instance_up{"))
    replacements = sum(1 for l in log if "replacement" in l and "starting on" in l)
    rejoins = sum(1 for l in log if "rejoining the cluster" in l)
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(180)
    print(json.dumps({"layout": " ".join(layout), "minutes": args.minutes,
                      "period_s": args.period, "events": len(events),
                      "requests": counts["sent"], "failed": counts["failed"],
                      "differed": counts["differed"], "kv_blocks_leaked": leaked,
                      "kv_blocks_quarantined": quarantined,
                      "reruns": m.get("duet_request_reruns_total", 0),
                      "replacements_started": replacements, "rejoins": rejoins,
                      "instances_up_at_end": up, "launcher_exit": code}, indent=1))
    for f in failures[:5]:
        print("failure:", f)
    return 0 if counts["failed"] == 0 and counts["differed"] == 0 and leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
