"""How long ``cosine-ray serve`` takes to answer, and the memory of every process it runs.

    python benchmarks/serve/serve_footprint.py [--starts 3] [--requests 8] [--max-tokens 64] [--gap-s 5]
        [-- SERVE ARGS...]

Each start runs ``cosine-ray serve --port P SERVE ARGS`` (default: the README's plain command,
the embedded model with the default config) on a new local Ray cluster, and records when
``/health`` first answers 200 (*ready*), when the CLI prints its serving line, and how long the
first chat completion takes, and the CPU-seconds the start's live processes have used by *ready*,
by role (on a machine with few cores a start is mostly CPU). After ``--requests`` completions
(the KV pool and step buffers at working size) it reads the memory of every process the start
created (``loadgen.chaos.procs``, as ``cosine-loadgen footprint`` does: RSS, PSS — shared pages
divided among their users, what sums to the machine's memory — and private anonymous memory)
and prints them, then their sums by role and by side (ours, Ray's and Serve's). Then SIGINT,
and the next start after ``--gap-s`` seconds of quiet. Timing is wall clock on a machine that
may be shared: the figures of every start are printed, not only the best, each beside the
machine's speed just before it (``import torch`` in a fresh interpreter, wall seconds: a start
runs it in three processes, and a machine whose speed varies from day to day shows it here).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from cosine_ray.bench.rounds import Spread
from loadgen.chaos import procs
from loadgen.chaos.memory import footprint
from loadgen.chaos.report import footprint_table
from loadgen.launcher import free_port

OURS = frozenset({"stage", "drafter", "engine", "ingress", "server_deploy", "server_cli"})
"""The roles of ``loadgen.chaos.procs`` that are our processes; the rest are Ray's and Serve's."""


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def chat(url: str, model: str, text: str, max_tokens: int) -> float:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - start


def cpu_by_role(processes: list[procs.Proc]) -> dict[str, float]:
    """CPU-seconds each role's live processes have used so far, and their sum as ``total``
    (processes that already exited, such as the deploying child, are not counted)."""
    out: dict[str, float] = {}
    for p in processes:
        if (seconds := procs.cpu_seconds(p.pid)) is not None:
            out[p.role] = out.get(p.role, 0.0) + seconds
    out["total"] = sum(out.values())
    return out


def import_torch_s() -> float:
    """Wall seconds of ``import torch`` in a fresh interpreter: the machine's speed now."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def one_start(serve_args: list[str], requests: int, max_tokens: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cosine_ray.cli", "serve", "--port", str(port), *serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    serving: list[float] = []
    tail: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            tail[:] = (tail + [line.rstrip()])[-30:]
            if "serving OpenAI API" in line and not serving:
                serving.append(time.perf_counter() - t0)
    threading.Thread(target=read, daemon=True).start()
    ready = None
    try:
        while proc.poll() is None and time.perf_counter() - t0 < 900:
            try:
                if get(f"{url}/health", timeout=1.0)[0] == 200:
                    ready = time.perf_counter() - t0
                    cpu = cpu_by_role(procs.descendants(procs.process_table(), [os.getpid()]))
                    break
            except OSError:
                pass
            time.sleep(0.1)
        if ready is None:
            raise RuntimeError("not ready: " + " | ".join(tail[-5:]))
        model = json.loads(get(f"{url}/v1/models")[1])["data"][0]["id"]
        first = chat(url, model, "Say hello.", 8)
        prompts = ["Write a Python function that reverses a string.", "What is 17 times 23?",
                   "Give three tips for a job interview.", "Tell me about your weekend."]
        for i in range(requests):
            chat(url, model, prompts[i % len(prompts)], max_tokens)
        table = procs.process_table()
        fp = footprint(p for p in procs.descendants(table, [os.getpid()]) if p.role != "other")
        return {"ready_s": ready, "serving_s": serving[0] if serving else None, "first_s": first,
                "footprint": fp, "cpu_at_ready": cpu}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def report(fp: dict) -> None:
    """Every process (``cosine-loadgen footprint``'s table), then the sums by role and by side."""
    footprint_table(fp, "Processes of the server")
    print("\n| role | n | RSS MiB | PSS MiB |")
    print("| --- | ---: | ---: | ---: |")
    sides = {"ours": [0.0, 0.0], "Ray and Serve": [0.0, 0.0]}
    for role, agg in sorted(fp["by_role"].items(), key=lambda kv: -kv[1]["pss_mib"]):
        print(f"| {role} | {agg['processes']} | {agg['rss_mib']:.0f} | {agg['pss_mib']:.0f} |")
        side = sides["ours" if role in OURS else "Ray and Serve"]
        side[0] += agg["rss_mib"]
        side[1] += agg["pss_mib"]
    for name, (rss, pss) in sides.items():
        print(f"| **{name}** | | {rss:.0f} | **{pss:.0f}** |")
    print(f"| **all {fp['num_processes']} processes** | | {fp['rss_mib']:.0f} | **{fp['pss_mib']:.0f}** |")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="chat completions before memory is read")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gap-s", type=float, default=5.0, help="quiet seconds between starts")
    args = ap.parse_args(argv)
    if args.starts < 1 or args.requests < 0 or args.max_tokens < 1:
        print("serve_footprint: --starts >= 1, --requests >= 0, --max-tokens >= 1", file=sys.stderr)
        return 2
    procs.set_child_subreaper()  # the daemons ray.init starts stay below this process, to be found
    results = []
    for i in range(args.starts):
        if i:
            time.sleep(args.gap_s)
        reference = import_torch_s()
        r = one_start(serve_args, args.requests, args.max_tokens)
        results.append(r)
        serving = f"{r['serving_s']:.1f} s" if r["serving_s"] is not None else "not printed"
        print(f"start {i + 1}: /health 200 after {r['ready_s']:.1f} s, serving line {serving}, "
              f"first completion {r['first_s']:.2f} s (import torch just before: {reference:.2f} s)", flush=True)
        cpu = r["cpu_at_ready"]
        print(f"  CPU-seconds at ready: {cpu['total']:.1f} (" + ", ".join(
            f"{role} {s:.1f}" for role, s in sorted(cpu.items(), key=lambda kv: -kv[1]) if role != "total")
            + ")", flush=True)
    ready = Spread.of([r["ready_s"] for r in results])
    print(f"\nready (/health 200) over {len(results)} starts: median {ready.median:.1f} s "
          f"({ready.low:.1f}-{ready.high:.1f})\n")
    print(f"memory after {args.requests} completions, last start:\n")
    report(results[-1]["footprint"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
