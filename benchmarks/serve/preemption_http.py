"""The preemption claim over HTTP: concurrent greedy completions through ``cosine-ray serve``
with a KV budget of a few contexts, every one complete and equal to HF greedy's text.

    python benchmarks/serve/preemption_http.py [--contexts 4] [--requests 32] [--port 8123]

Starts ``cosine-ray serve --kv-cache-memory B --max-num-seqs N`` (its default two stages: B
holds ``--contexts`` contexts of prompt + output + a tree across the stages), sends the requests
at once with the ``openai`` client (``ignore_eos``, temperature 0), reads
``cosine_ray:num_preemptions_total`` from ``/metrics``, stops the server, then decodes HF
transformers' greedy output (fp32) for each prompt and compares the texts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import time

import httpx

from cosine_ray.bench.reference import hf_greedy_all
from cosine_ray.bench.workloads import fixed_length_prompts
from cosine_ray.models.loader import resolve_checkpoint


def wait_ready(base: str, server: subprocess.Popen, timeout_s: float = 900) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            break
        time.sleep(1)
    raise SystemExit("the server did not come up; see its log")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--contexts", type=int, default=4, help="requests' contexts the KV budget holds")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--log", default="preemption_http_server.log")
    args = p.parse_args()
    from openai import AsyncOpenAI

    ck = resolve_checkpoint("smollm2-135m")
    tokenizer = ck.load_tokenizer()
    prompts = fixed_length_prompts(tokenizer, args.requests, args.prompt_tokens)
    c = ck.config
    per_token_per_stage = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 / args.stages  # fp32 K and V
    budget = int(args.contexts * (args.prompt_tokens + args.output_tokens + 16) * per_token_per_stage)
    cmd = ["cosine-ray", "serve", "--port", str(args.port), "--stages", str(args.stages),
           "--kv-cache-memory", str(budget), "--max-num-seqs", str(args.requests)]
    print(" ".join(cmd), f"({budget / 2**20:.1f} MiB a stage)", flush=True)
    base = f"http://127.0.0.1:{args.port}"
    with open(args.log, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        print(f"ready after {wait_ready(base, server):.0f} s", flush=True)
        client = AsyncOpenAI(base_url=base + "/v1", api_key="x", timeout=1800, max_retries=0)

        async def one(prompt):
            r = await client.completions.create(model=ck.name, prompt=prompt, max_tokens=args.output_tokens,
                                                temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].text, r.usage.completion_tokens

        async def run_all():
            return await asyncio.gather(*(one(pr) for pr in prompts), return_exceptions=True)

        start = time.monotonic()
        outs = asyncio.run(run_all())
        errors = [o for o in outs if isinstance(o, BaseException)]
        done = sum(1 for o in outs if not isinstance(o, BaseException) and o[1] == args.output_tokens)
        print(f"{done}/{len(prompts)} complete with {args.output_tokens} tokens in {time.monotonic() - start:.0f} s; "
              f"errors: {len(errors)} {errors[:2]}")
        metrics = httpx.get(base + "/metrics", timeout=30).text
        print("preemptions:", [ln for ln in metrics.splitlines() if "num_preemptions" in ln and ln[0] != "#"])
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    refs = hf_greedy_all(ck, prompts, args.output_tokens, ignore_eos=True)
    same = sum(not isinstance(out, BaseException) and out[0] == tokenizer.decode(ref, skip_special_tokens=True)
               for out, ref in zip(outs, refs))
    print(f"text identical to HF greedy (fp32, decoded): {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
