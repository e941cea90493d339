"""The step runner's fixed-shape path (``models.runner``, the layout CUDA graphs replay) against
the eager varlen forward: the same logits for mixed steps over two stages (prefills past the
largest bucket fall back to eager; short prompts, chains and random token trees go through
the buckets), requests joining, committing random accepted paths and leaving, a CPU pool that
grows under it; and the engine on the static runner token-identical to HF greedy. On CPU the
fixed-shape step runs eagerly ("static"); ``tests/engine/test_gpu.py`` replays it as graphs."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, StepConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.runner import GRAPH_NEW_TOKENS, StepRunner, _slots_bucket
from hf_reference import hf_greedy
from runner_steps import compare_runners


def test_static_path_equals_eager_over_mixed_steps(tiny_checkpoint):
    static = compare_runners(tiny_checkpoint, "static")
    stats = [s.runner.stats for s in static.stages]
    assert all(s["static"] == 10 and s["eager"] == 4 for s in stats), stats  # prefill steps eager, the rest static
    grown = [s.cache.num_blocks for s in static.stages]
    assert all(b > 16 for b in grown), grown  # the CPU pool grew under the static path


def test_buckets():
    assert _slots_bucket(1, 16) == 256 and _slots_bucket(257, 16) == 512
    assert _slots_bucket(10**6, 16) is None
    assert GRAPH_NEW_TOKENS[-1] == 32


def test_runner_modes(tiny_checkpoint):
    stage = LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict())
    assert StepRunner(stage).mode == "eager"  # auto on CPU
    with pytest.raises(ValueError, match="CUDA"):
        StepRunner(stage, "graph")
    with pytest.raises(ValueError, match="runner"):
        StepRunner(stage, "fast")
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(runner="fast")
    with pytest.raises(ValueError, match="cuda"):
        EngineConfig(runner="graph", device="cpu")


@pytest.mark.parametrize("drafters", ["none", "ngram,self"])
def test_engine_on_static_runner_equals_hf_greedy(tiny_checkpoint, drafters):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 17, 45)] + [list(range(30, 40)) * 3]
    hf = tiny_checkpoint.load_hf_model()
    want = [hf_greedy(hf, p, 24) for p in prompts]
    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(drafters),
                                      runner="static", step=StepConfig(max_batch_size=4)), checkpoint=tiny_checkpoint)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [o.new_token_ids for o in outs] == want
    assert engine.target.stages[0].runner.stats["static"] > 0


def test_idle_bucket_touches_only_the_scratch_block(tiny_checkpoint):
    """What a capture at start runs (``StepRunner.capture``): a bucket with every row padding.
    Its KV writes land in the scratch block alone, so capturing while requests hold KV is safe."""
    from cosine_ray.models.runner import startup_keys

    stage = LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict())
    runner = StepRunner(stage, "static")
    cache = stage.new_kv_cache()
    cache.allocate("r")
    cache.reserve("r", 40)
    with torch.inference_mode():
        cache.pool.normal_()  # every slot holds something a stray write would change
    cache.commit("r")
    before = cache.pool.clone()
    scratch = cache.scratch_block()
    keys = startup_keys(4, 9, 300, cache.block_size)
    assert (4, 16, 512) in keys and (1, 1, 256) in keys and len(keys) == 3 * 5 * 2
    for key in keys:
        bucket = runner._bucket_for(key, cache)
        assert runner._fill(bucket, None, cache) == (0, 0)
        with torch.inference_mode():
            out = runner._run(bucket, cache)
        assert torch.isfinite(out).all()
    changed = (cache.pool != before).flatten(3).any(-1).any(0).any(0)  # [slots]
    slots = changed.nonzero().flatten().tolist()
    bs = cache.block_size
    assert slots and all(s // bs == scratch for s in slots), slots
    assert runner.capture(cache, keys) == 0  # graphs only in graph mode
