"""The profiling pass behind the scheduler's latency models (``cosine-ray profile``).

It measures the real in-process target (the same ``TargetWorker`` over ``LlamaStage`` slices
that the engine runs) and the configured drafters, fits ``algo.scheduling.latency_model.LatencyModel``
and stores it as JSON under ``profile_path``
(``<cache>/profiles/<model>-<device>-<dtype>-s<stages>-t<threads>-d<drafters>.json``; each
setup keeps its own; ``$COSINE_RAY_PROFILE_DIR`` replaces the directory). Measured:

- **verify forwards** over a grid of batch sizes b, draft budgets γ (a chain of 1 + γ nodes
  per request) and context lengths l, each the median of ``repeats`` timed runs over the
  same committed KV;
- **prefills** of one request of l tokens;
- **drafters' ``propose``** over b and γ on repetitive contexts (the expensive case).

Quick mode (a server's first start) uses a 3 × 3 × 2 grid and 3 repetitions; the full mode
a 5 × 5 × 4 grid and 5 repetitions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cosine_ray.algo.scheduling.latency_model import LLM_TERMS, LatencyModel, LlmSample, SsmSample
from cosine_ray.algo.tree import TokenTree
from cosine_ray.models import kernels
from cosine_ray.engine.build import build_drafter
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.base import DraftInput
from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.models.loader import cache_root, load_target, resolve_checkpoint
from cosine_ray.models.device import synchronize
from cosine_ray.models.linear import projection_kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    batch_sizes: tuple[int, ...]
    gammas: tuple[int, ...]
    context_lens: tuple[int, ...]
    warmup: int
    repeats: int

    @classmethod
    def for_mode(cls, quick: bool) -> "ProfileGrid":
        if quick:
            return cls((1, 4, 8), (0, 4, 8), (64, 256), warmup=1, repeats=3)
        return cls((1, 2, 4, 8, 16), (0, 2, 4, 8, 16), (32, 128, 512, 1024), warmup=2, repeats=5)


def profile_threads(config: EngineConfig) -> int:
    """The torch intra-op threads a profile of ``config`` is (or would be) measured with:
    ``config.num_threads``, else this process's current setting (the engine replica pins 1,
    the in-process engine keeps torch's default)."""
    return int(config.num_threads or torch.get_num_threads())


def drafter_set_digest(config: EngineConfig) -> str:
    """8 hex digits naming the configured drafter *set* (order does not matter; ``none`` for
    plain decoding). Drafters are named by kind and full source (``retrieval:/a/x.parquet``
    and ``retrieval:/b/x.parquet`` differ although both are called ``retrieval:x``)."""
    specs = sorted(s.kind + (f":{s.source}" if s.source else "") for s in config.drafters)
    return hashlib.sha1(",".join(specs or ["none"]).encode()).hexdigest()[:8]


def profile_path(config: EngineConfig) -> Path:
    """``cache_root()/profiles/<model>-<device>-<dtype>-s<stages>-t<threads>-d<drafters>[-k<kernel>][-w<weights>].json``.

    Everything the measured costs depend on is in the name, so different setups keep their
    own profile instead of overwriting each other's (``cosine-ray serve`` and ``serve run`` of
    another config used to re-profile at every start): the pipeline stages, the torch thread
    count the verify forward runs with (``profile_threads``: a 1-thread engine replica and a
    multi-threaded in-process engine have very different costs) and the drafter set
    (``drafter_set_digest``), and on CPU the projection kernel (``-konednn`` / ``-kmkl``,
    ``models.llama.projection_kernel``: their verify costs grow very differently with the
    tokens of a step; ours, ``-kblocked[-fused]-DIGEST``, also by a digest of their source, since
    a change to them changes every cost). A model given as a path is named by its last component
    plus a short hash of the full path."""
    spec = str(config.model)
    kernel = projection_kernel(config.device)
    if kernel == "blocked":
        kernel += ("-fused" if kernels.fused_on(config.device, config.dtype) else "") + f"-{kernels.source_digest()}"
    kernel = f"-k{kernel}" if kernel != "default" else ""
    kernel += f"-w{config.weights}" if config.weights != "dense" else ""  # quantized steps cost less
    name = Path(spec).name or spec
    if name != spec:
        name = f"{name}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{name}-{config.device}-{config.dtype}-s{config.num_stages}"
                                             f"-t{profile_threads(config)}-d{drafter_set_digest(config)}{kernel}")
    return profile_dir() / f"{slug}.json"


PROFILE_DIR_ENV = "COSINE_RAY_PROFILE_DIR"


def profile_dir() -> Path:
    """``$COSINE_RAY_PROFILE_DIR``, or ``cache_root()/profiles``. The engine loads the profile it
    finds there, so whatever wrote it steers the scheduler: the test suite points this at a
    directory of its own, so that a developer's profiles don't change what the tests do and
    the tests' profiles (many tiny temporary models) don't pile up in the user's cache."""
    env = os.environ.get(PROFILE_DIR_ENV)
    return Path(env).expanduser() if env else cache_root() / "profiles"


def median_seconds(run: Callable[[], object], warmup: int, repeats: int, device: str = "cpu") -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain(root: int, length: int, rng: random.Random, vocab: int) -> TokenTree:
    tokens = (root, *(rng.randrange(vocab) for _ in range(length)))
    return TokenTree(tokens, tuple(range(-1, length)), (1.0,) * (length + 1))


def measure_target(worker: TargetWorker, vocab_size: int, grid: ProfileGrid, max_len: int,
                   seed: int = 0) -> list[LlmSample]:
    """Verify forwards over the grid (plus one-request prefills), medians of ``repeats``."""
    rng = random.Random(seed)
    samples: list[LlmSample] = []
    b_max = max(grid.batch_sizes)
    device = str(worker.stages[0].stage.device)
    for ctx in grid.context_lens:
        ctx = min(ctx, max_len - max(grid.gammas) - 2)
        ids = [f"profile-{ctx}-{i}" for i in range(b_max)]
        prefill_times = []
        for rid in ids:
            prompt = [rng.randrange(vocab_size) for _ in range(ctx)]
            synchronize(device)
            start = time.perf_counter()
            worker.score([ScoreItem.prefill(rid, prompt)])
            synchronize(device)
            prefill_times.append(time.perf_counter() - start)
        samples.append(LlmSample((0,), (ctx,), statistics.median(prefill_times[1:] or prefill_times)))
        pending: dict[str, tuple[int, ...]] = {rid: tuple(range(ctx)) for rid in ids}
        for b in grid.batch_sizes:
            for gamma in grid.gammas:
                trees = [_chain(rng.randrange(vocab_size), gamma, rng, vocab_size) for _ in range(b)]

                def forward() -> None:
                    items = [ScoreItem.for_tree(rid, tree, ctx) for rid, tree in zip(ids, trees)]
                    worker.score(items, [KVCommit(rid, pending[rid]) for rid in ids[:b]])
                    for rid in ids[:b]:
                        pending[rid] = ()  # keep nothing of this step: the context stays ctx

                seconds = median_seconds(forward, grid.warmup, grid.repeats, device)
                samples.append(LlmSample((ctx,) * b, (1 + gamma,) * b, seconds))
        worker.release(ids)
    return samples


def measure_drafter(drafter, vocab_size: int, grid: ProfileGrid, seed: int = 0) -> list[SsmSample]:
    """``propose`` for b requests × budget γ on repetitive contexts growing 2 tokens a call."""
    rng = random.Random(seed)
    samples: list[SsmSample] = []
    for b in grid.batch_sizes:
        for gamma in [g for g in grid.gammas if g > 0]:
            ids = [f"profile-draft-{b}-{gamma}-{i}" for i in range(b)]
            patterns = [[rng.randrange(vocab_size) for _ in range(12)] for _ in ids]
            contexts = [(p * 12)[:120] for p in patterns]

            def propose() -> None:
                drafter.propose([DraftInput(rid, tuple(c), gamma) for rid, c in zip(ids, contexts)])
                for c, p in zip(contexts, patterns):
                    c.extend(p[(len(c) + k) % 12] for k in range(2))

            seconds = median_seconds(propose, grid.warmup, grid.repeats)
            samples.append(SsmSample(drafter.name, b, b * gamma, seconds))
            for rid in ids:
                drafter.release(rid)
    return samples


def run_profile(config: EngineConfig, *, quick: bool) -> LatencyModel:
    """Measure the target (and ``config.drafters``) in this process and fit the models."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    grid = ProfileGrid.for_mode(quick)
    loaded = load_target(resolve_checkpoint(config.model, **config.checkpoint_args), weights=config.weights,
                         dtype=config.dtype, device=config.device, num_stages=config.num_stages)
    checkpoint = loaded.checkpoint
    worker = TargetWorker(loaded.stages, kv_cache_memory=config.kv_cache_memory, runner=config.runtime.runner)
    vocab = checkpoint.config.vocab_size
    llm = measure_target(worker, vocab, grid, checkpoint.config.max_position_embeddings)
    ssm: list[SsmSample] = []
    for spec in config.drafters:
        drafter = build_drafter(spec, target=checkpoint, config=config, target_state=loaded.weights)
        ssm += measure_drafter(drafter, vocab, grid)
    return LatencyModel.fit(llm, ssm, model_name=checkpoint.name, device=config.device, dtype=config.dtype,
                            num_stages=config.num_stages, num_threads=profile_threads(config))


def save_profile(model: LatencyModel, path: str | Path) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(model.to_json(), encoding="utf-8")
    tmp.replace(path)  # atomic: a server never reads half a profile
    return path


def load_or_profile(config: EngineConfig, *, quick: bool = True) -> LatencyModel:
    """The profile stored for this setup (``profile_path``: model, device, dtype, stages,
    threads, drafter set) if there is one and it covers the configured drafters, else run the
    pass now (quick by default) and store it."""
    path = profile_path(config)
    if path.is_file():
        try:
            model = LatencyModel.from_json(path.read_text(encoding="utf-8"))
            missing = [s.name for s in config.drafters if s.name not in model.ssm]
            if not missing:
                log.info("latency profile loaded from %s", path)
                return model
            log.warning("latency profile %s lacks drafter(s) %s; profiling again", path, missing)
        except (OSError, ValueError) as exc:
            log.warning("latency profile %s is unusable (%s); profiling again", path, exc)
    start = time.perf_counter()
    model = run_profile(config, quick=quick)
    save_profile(model, path)
    log.warning("latency profile of %s measured in %.1f s (%s mode) -> %s", model.model_name,
                time.perf_counter() - start, "quick" if quick else "full", path)
    return model


def format_table(model: LatencyModel) -> str:
    """Measured vs predicted for every sample, and the fit diagnostics."""
    lines = [f"{'forward':<28} {'measured ms':>12} {'predicted ms':>13} {'error':>7}"]
    for s in model.llm_samples:
        pred = model.predict_llm(s.context_lens, s.num_new_tokens)
        what = (f"prefill {s.num_new_tokens[0]}" if s.context_lens == (0,)
                else f"b={len(s.context_lens)} γ={s.num_new_tokens[0] - 1} l={s.context_lens[0]}")
        lines.append(f"{what:<28} {s.seconds * 1e3:>12.2f} {pred * 1e3:>13.2f} {(pred / s.seconds - 1):>7.1%}")
    for s in model.ssm_samples:
        pred = model.predict_ssm(s.drafter, s.num_requests, s.num_draft_tokens)
        what = f"{s.drafter} b={s.num_requests} Γ={s.num_draft_tokens}"
        lines.append(f"{what:<28} {s.seconds * 1e3:>12.3f} {pred * 1e3:>13.3f} {(pred / s.seconds - 1):>7.1%}")
    lines.append("T_llm = " + " + ".join(f"{n} {c * 1e3:.4g} ms" for n, c in zip(LLM_TERMS, model.llm.coefs))
                 + f", knee at {model.knee_tokens or 'none'} tokens"
                 + f"  (R² {model.llm.r2:.3f}, max error {model.llm.max_rel_error:.1%})")
    for name, fit in model.ssm.items():
        lines.append(f"T_ssm[{name}] = " + " + ".join(f"{n} {c * 1e3:.4g} ms" for n, c in
                                                     zip(("c0", "c_req", "c_tok"), fit.coefs))
                     + f"  (R² {fit.r2:.3f}, max error {fit.max_rel_error:.1%})")
    return "\n".join(lines)
