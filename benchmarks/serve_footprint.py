"""How long ``cosine-ray serve`` takes to answer, and the memory of every process it runs.

    python benchmarks/serve_footprint.py [--starts 3] [--requests 8] [--max-tokens 64] [--gap-s 5]
        [-- SERVE ARGS...]

Each start runs ``cosine-ray serve --port P SERVE ARGS`` (default: the README's plain command,
the embedded model with the default config) on a new local Ray cluster, and records when
``/health`` first answers 200 (*ready*), when the CLI prints its serving line, and how long the
first chat completion takes. After ``--requests`` completions (the KV pool and step buffers at
working size) it reads ``/proc/PID/smaps_rollup`` of every process the start created and prints
them by role: RSS, PSS (shared pages divided among their users: what sums to the machine's
memory) and USS (pages no other process maps). Then SIGINT, and the next start after
``--gap-s`` seconds of quiet. Timing is wall clock on a machine that may be shared: the figures
of every start are printed, not only the best.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROLES = (  # (role, what its command line contains), first match wins
    ("stage", "ray::StageHost"), ("drafter actor", "ray::DrafterHost"),
    ("engine replica", "cosine_ray_engine"), ("ingress replica", "ServeReplica:"),
    ("Serve controller", "ray::ServeController"), ("Serve proxy", "ray::ProxyActor"),
    ("deploying child", "cosine_ray.cli.serve_start"), ("CLI (Ray driver)", "cosine-ray serve"),
    ("CLI (Ray driver)", "cosine_ray.cli serve"),
    ("Ray: GCS", "gcs_server"), ("Ray: raylet", "raylet/raylet"), ("Ray: dashboard", "dashboard.py"),
    ("Ray: dashboard agent", "DashboardAgent"), ("Ray: runtime env agent", "RuntimeEnvAgent"),
    ("Ray: log monitor", "log_monitor.py"), ("Ray: autoscaler monitor", "monitor.py"),
    ("Ray: idle worker", "default_worker.py"),
)
OURS = {"stage", "drafter actor", "engine replica", "ingress replica", "deploying child", "CLI (Ray driver)"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def memory_kib(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS of one process (KiB), from smaps_rollup; None if it is gone."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    except (OSError, ValueError):
        return None
    return {"rss": fields.get("Rss", 0), "pss": fields.get("Pss", 0),
            "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)}


def role(cmd: str) -> str | None:
    return next((name for name, needle in ROLES if needle in cmd), None)


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


def one_start(serve_args: list[str], requests: int, max_tokens: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    before = pids()
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
        procs = []
        for pid in sorted(pids() - before):
            cmd_text = cmdline(pid)
            name = role(cmd_text)
            mem = memory_kib(pid) if name else None
            if mem:
                procs.append({"pid": pid, "role": name, **mem})
        return {"ready_s": ready, "serving_s": serving[0] if serving else None, "first_s": first, "procs": procs}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def report(result: dict) -> None:
    by_role: dict[str, list[dict]] = {}
    for p in result["procs"]:
        by_role.setdefault(p["role"], []).append(p)
    print("| process | n | RSS MiB | PSS MiB | USS MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    order = [name for name, _ in ROLES]
    totals = {"ours": [0, 0, 0], "Ray and Serve": [0, 0, 0]}
    for name in sorted(by_role, key=order.index):
        rows = by_role[name]
        rss, pss, uss = (sum(p[k] for p in rows) / 1024 for k in ("rss", "pss", "uss"))
        print(f"| {name} | {len(rows)} | {rss:.0f} | {pss:.0f} | {uss:.0f} |")
        side = totals["ours" if name in OURS else "Ray and Serve"]
        side[0] += rss
        side[1] += pss
        side[2] += uss
    for side, (rss, pss, uss) in totals.items():
        print(f"| **{side}** | | {rss:.0f} | **{pss:.0f}** | {uss:.0f} |")
    print(f"| **all {len(result['procs'])} processes** | | {sum(t[0] for t in totals.values()):.0f} | "
          f"**{sum(t[1] for t in totals.values()):.0f}** | {sum(t[2] for t in totals.values()):.0f} |")


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
    results = []
    for i in range(args.starts):
        if i:
            time.sleep(args.gap_s)
        r = one_start(serve_args, args.requests, args.max_tokens)
        results.append(r)
        serving = f"{r['serving_s']:.1f} s" if r["serving_s"] is not None else "not printed"
        print(f"start {i + 1}: /health 200 after {r['ready_s']:.1f} s, serving line {serving}, "
              f"first completion {r['first_s']:.2f} s", flush=True)
    ready = [r["ready_s"] for r in results]
    print(f"\nready (/health 200) over {len(ready)} starts: median {statistics.median(ready):.1f} s "
          f"({min(ready):.1f}-{max(ready):.1f})\n")
    print(f"memory after {args.requests} completions, last start:\n")
    report(results[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
