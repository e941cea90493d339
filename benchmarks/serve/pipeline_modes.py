"""Single-request speed of the pipeline modes on stage actors of a real local Ray cluster.

One engine per system, built the way the Serve deployment builds it (``EngineCore`` over a Ray
target client with one stage actor per stage, lookup drafters in the engine process), runs the
same held-back prompts one at a time (a request alone in the pool, PipeDec's case). Systems:
one stage plain and with trees (lanes); S stages plain, lanes, PipeDec per layer width (with
and without its mode guard); and lanes with PEARL off / on / auto per ``--pearl-drafters`` set
(model drafters in actors of their own). Prints tok/s, ratios to ``S=1 lanes`` and ``S=N
lanes``, tokens per target call, PipeDec's hit rate, and whether every output is identical to
the first system's (docs/benchmarks.md).

    python benchmarks/serve/pipeline_modes.py --stages 2 --widths 1,2,4 --prompts-per-domain 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import ray
import torch

from cosine_ray.datasets import held_back_prompts
from cosine_ray.engine.build import eos_token_ids, make_drafter_worker
from cosine_ray.engine.components import cosine_components
from cosine_ray.engine.config import DEFAULT_DRAFTERS, config_from_dict, step_config_for
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.owners.drafting import LocalDrafterClient
from cosine_ray.engine.local import encode_prompt
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.runtime.actors import DrafterActor
from cosine_ray.runtime.clients import ActorSlot, RayDrafterClient, RayTargetClient, await_ref
from cosine_ray.runtime.engine_server import stage_slots
from cosine_ray.runtime.placement import actor_options


async def run_system(name: str, config_data: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    config = config_from_dict(config_data)
    checkpoint = resolve_checkpoint(config.model)
    tokenizer = checkpoint.load_tokenizer()
    namespace = f"bench.{uuid.uuid4().hex[:6]}"
    slots = stage_slots(config, namespace)
    drafters, drafter_slots = [], []
    for i, spec in enumerate(config.drafters):  # as the Serve deployment places them
        if spec.kind in config.cluster.drafters_in_engine:
            drafters.append(LocalDrafterClient(make_drafter_worker(spec, config)))
            continue
        options = {**actor_options("drafter", i, config), "namespace": namespace}
        slot = ActorSlot(f"bench-drafter-{i}", lambda o=options, sp=spec: DrafterActor.options(**o).remote(config, sp),
                         namespace=namespace)
        drafter_slots.append(slot)
        drafters.append(RayDrafterClient(slot, spec.name, deadline_s=config.step.drafter_deadline_s))
    await asyncio.gather(*(await_ref(s.handle.ping.remote(), 600) for s in [*slots, *drafter_slots]))
    core = EngineCore(step_config_for(config, checkpoint), RayTargetClient(slots, deadline_s=120.0), drafters,
                      vocab_size=checkpoint.config.vocab_size, eos_token_ids=eos_token_ids(checkpoint, tokenizer),
                      **cosine_components(config, checkpoint))
    loop = EngineLoop(core)
    params = SamplingParams(max_tokens=max_tokens)
    try:
        await loop.generate_all(prompts[0], SamplingParams(max_tokens=8))  # warm-up
        outputs, elapsed = [], 0.0
        for ids in prompts:
            start = time.perf_counter()
            out = await loop.generate_all(ids, params)
            elapsed += time.perf_counter() - start
            outputs.append(out)
    finally:
        await loop.shutdown()
        for s in [*slots, *drafter_slots]:
            ray.kill(s.handle, no_restart=True)
    tokens = sum(len(o.new_token_ids) for o in outputs)
    timesteps = sum(o.stats.pipedec_timesteps for o in outputs)
    steps = sum(o.stats.num_verify_steps for o in outputs)
    calls = (timesteps + steps) or tokens  # PipeDec timesteps and lanes verify steps (the guard runs both)
    pearl = core.pearl.stats if core.pearl is not None else None
    return {"system": name, "tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "pearl_post_verify_share": pearl.post_verify / max(1, pearl.steps) if pearl else None,
            "tokens_per_call": tokens / calls if calls else 0.0,
            "hit_rate": sum(o.stats.pipedec_hits for o in outputs) / max(1, sum(o.stats.pipedec_tokens for o in outputs))
            if timesteps else None,
            "outputs": [list(o.new_token_ids) for o in outputs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--widths", default="1,2,4", help="PipeDec nodes per tree layer, comma list")
    p.add_argument("--depths", default="0", help="PipeDec tree layers below the root, comma list (0: S)")
    p.add_argument("--guard-width", type=int, default=4,
                   help="also run PipeDec with its mode guard at this width (0: no)")
    p.add_argument("--pearl-drafters", default="",
                   help="semicolon list of drafter sets to run in lanes without and with PEARL, e.g. 'self;ngram'")
    p.add_argument("--pearl-gamma", type=int, default=4, help="the window γ of the PEARL comparison")
    p.add_argument("--skip-pipedec", action="store_true", help="only the plain, lanes and PEARL systems")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage actor")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="bench-results/pipeline_modes.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    checkpoint = resolve_checkpoint(args.model)
    tokenizer = checkpoint.load_tokenizer()
    prompts = [encode_prompt(tokenizer, t) for _, t in held_back_prompts(None, args.prompts_per_domain)]
    S = args.stages
    base = {"model": args.model, "drafters": args.drafters,
            "cluster": {"threads_per_actor": args.threads, "num_cpus_per_actor": 0}}
    systems = [("S=1 plain", {**base, "drafters": "none", "num_stages": 1}),
               ("S=1 lanes", {**base, "num_stages": 1})]
    if S > 1:
        systems += [(f"S={S} plain", {**base, "drafters": "none", "num_stages": S, "step": {"num_lanes": S}}),
                    (f"S={S} lanes", {**base, "num_stages": S, "step": {"num_lanes": S}})]
    for depth in ([] if args.skip_pipedec else (int(d) for d in args.depths.split(","))):
        for width in (int(w) for w in args.widths.split(",")):
            label = f"S={S} pipedec w{width}" + (f" d{depth}" if depth else "")
            systems.append((label, {**base, "num_stages": S, "step": {
                "num_lanes": S, "pipeline_mode": "pipedec", "pipedec_width": width, "pipedec_depth": depth,
                "pipedec_guard": False}}))
    for drafters in filter(None, args.pearl_drafters.split(";")):
        for pearl in ("off", "on", "auto"):
            systems.append((f"S={S} {'lanes' if pearl == 'off' else 'pearl ' + pearl} [{drafters}]", {
                **base, "drafters": drafters, "num_stages": S,
                "step": {"num_lanes": S, "pearl": pearl, "num_speculative_tokens": args.pearl_gamma}}))
    if args.guard_width and not args.skip_pipedec:
        systems.append((f"S={S} pipedec+guard w{args.guard_width}", {**base, "num_stages": S, "step": {
            "num_lanes": S, "pipeline_mode": "pipedec", "pipedec_width": args.guard_width}}))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for name, data in systems:
            r = asyncio.run(run_system(name, data, prompts, args.max_tokens))
            results.append(r)
            print(f"{name:<22} {r['tok_s']:7.2f} tok/s", flush=True)
    finally:
        ray.shutdown()
    ref = {r["system"]: r for r in results}
    one, lanes = ref["S=1 lanes"]["tok_s"], ref[f"S={S} lanes"]["tok_s"]
    first = results[0]["outputs"]
    print(f"\n{len(prompts)} held-back prompts, {args.max_tokens} tokens, one request at a time, "
          f"{args.threads} thread(s) per stage actor, drafters {args.drafters}")
    print(f"| system | tok/s | × S=1 lanes | × S={S} lanes | tokens per target call | PipeDec hit rate | "
          f"PEARL post-verify steps | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        hit = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "-"
        post = f"{r['pearl_post_verify_share']:.0%}" if r["pearl_post_verify_share"] is not None else "-"
        same = sum(a == b for a, b in zip(r["outputs"], first))
        print(f"| {r['system']} | {r['tok_s']:.2f} | {r['tok_s'] / one:.2f}× | {r['tok_s'] / lanes:.2f}× | "
              f"{r['tokens_per_call']:.2f} | {hit} | {post} | {same}/{len(first)} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
