"""The step runner's fixed-shape path (``models.runner``, the layout CUDA graphs replay) against
the eager varlen forward: the same logits for mixed steps over two stages (prefills past the
largest bucket fall back to eager; short prompts, chains and random token trees go through
the buckets), requests joining, committing random accepted paths and leaving, a CPU pool that
grows under it; and the engine on the static runner token-identical to HF greedy. On CPU the
fixed-shape step runs eagerly ("static"); ``tests/engine/test_gpu.py`` replays it as graphs."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.runner import GRAPH_NEW_TOKENS, StepRunner, _slots_bucket
from support.hf_reference import hf_greedy
from support.runner_steps import compare_runners


def test_static_path_equals_eager_over_mixed_steps(tiny_checkpoint):
    static = compare_runners(tiny_checkpoint, "static")
    stats = [s.runner.stats for s in static.stages]
    # 10 steps through one bucket; the 4 with a prompt past the verify buckets through two (the
    # prompt in a prefill bucket, the rest in a verify bucket), none eagerly
    assert all(s["static"] == 10 + 2 * 4 and s["eager"] == 0 for s in stats), stats
    grown = [s.cache.num_blocks for s in static.stages]
    assert all(b > 16 for b in grown), grown  # the CPU pool grew under the static path


def test_a_verify_bucket_of_the_engines_whole_tree_equals_eager(tiny_checkpoint):
    """``StepRunner.tree_size(9)`` (γ_max 8 + the root, what an engine adds at start): a step
    whose largest tree has 9 nodes takes a 9-row bucket instead of 16, with the eager forward's
    logits; the mixed steps of ``compare_runners`` still match with the extra bucket."""
    from cosine_ray.engine.config import SpeculationConfig
    from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
    from cosine_ray.models.runner import startup_keys
    from support.runner_steps import random_tree, workers

    compare_runners(tiny_checkpoint, "static", tree_size=9)
    eager, static = workers(tiny_checkpoint, "eager"), workers(tiny_checkpoint, "static")
    for stage in static.stages:
        stage.runner.tree_size(9)
        assert stage.runner.new_tokens == (1, 2, 4, 8, 9, 16, 32)
    g = torch.Generator().manual_seed(9)
    prompts = {"a": torch.randint(0, 256, (12,), generator=g).tolist(), "b": torch.randint(0, 256, (7,), generator=g).tolist()}
    for w in (eager, static):
        w.score([ScoreItem.prefill(rid, p) for rid, p in prompts.items()])
        w.commit([KVCommit(rid, tuple(range(len(p)))) for rid, p in prompts.items()])
    trees = {"a": random_tree(9, g), "b": random_tree(3, g)}
    items = [ScoreItem.for_tree(rid, t, len(prompts[rid]), ids_only=False) for rid, t in trees.items()]
    want, got = eager.score(items), static.score(items)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for stage in static.stages:
        assert (2, 9, 256) in stage.runner._buckets, list(stage.runner._buckets)
    keys = startup_keys(8, SpeculationConfig().num_speculative_tokens + 1, 8192, 16, new_tokens=static.stages[0].runner.new_tokens)
    assert {n for _, n, _ in keys} == {1, 2, 4, 8, 9} and len(keys) == 4 * 5 * 3


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
        EngineConfig().replace(runner="fast")
    with pytest.raises(ValueError, match="cuda"):
        EngineConfig(device="cpu").replace(runner="graph")


@pytest.mark.parametrize("drafters", ["none", "ngram,self"])
def test_engine_on_static_runner_equals_hf_greedy(tiny_checkpoint, drafters):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 17, 45)] + [list(range(30, 40)) * 3]
    hf = tiny_checkpoint.load_hf_model()
    want = [hf_greedy(hf, p, 24) for p in prompts]
    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(drafters)).replace(
        runner="static", max_num_seqs=4), checkpoint=tiny_checkpoint)
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
    assert len(startup_keys(4, 9, 300, cache.block_size)) == 3 * 5 * 2
    keys = startup_keys(4, 9, 300, cache.block_size, prefills=True)
    # verify buckets, then prefill buckets whose rows fit their context: 64-256 in 256 slots, 64-512 in 512
    assert (4, 16, 512) in keys and (1, 1, 256) in keys and (4, 512, 512) in keys and (2, 512, 256) not in keys
    assert len(keys) == 3 * 5 * 2 + 3 * (3 + 4)
    rows = [b * n for b, n, _ in keys]
    assert rows == sorted(rows, reverse=True)  # most rows first: the others reuse that memory
    short = startup_keys(4, 9, 100, cache.block_size, prefills=True)  # prompts of at most 100 tokens
    assert {n for _, n, _ in short if n > 32} == {64, 128}
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


@pytest.mark.parametrize("num_stages", [1, 2])
def test_prompts_go_through_a_prefill_bucket_or_run_eagerly(tiny_checkpoint, num_stages):
    """Several prompts of different lengths in one step, with and without decoding requests
    beside them: the static runner's two buckets give the eager forward's logits. A prompt past
    the largest prefill bucket, or one that needs every row's logits, runs the step eagerly."""
    from cosine_ray.models.config import stage_slices
    from cosine_ray.models.llama import StageBatch
    from cosine_ray.models.runner import MAX_PREFILL_ROWS, PREFILL_NEW_TOKENS

    state = tiny_checkpoint.load_state_dict()

    def chain(runner_mode):
        stages = [LlamaStage(tiny_checkpoint.config, state, a, b)
                  for a, b in stage_slices(tiny_checkpoint.config.num_layers, num_stages)]
        return [(StepRunner(st, runner_mode), st.new_kv_cache()) for st in stages]

    def run(pipe, batch):
        hidden = None
        with torch.inference_mode():
            for runner, cache in pipe:
                hidden = runner.forward(batch, cache, hidden)
        for _, cache in pipe:
            for rid, n in zip(batch.request_ids, batch.num_new_tokens):
                cache.commit(rid)
        return hidden

    g = torch.Generator().manual_seed(5)
    eager, static = chain("eager"), chain("static")
    for pipe in (eager, static):
        for _, cache in pipe:
            for rid in ("a", "b", "c", "d", "e", "f"):
                cache.allocate(rid)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    steps = [
        StageBatch.from_chains(["a", "b", "c"], [ids(33), ids(100), ids(70)], [0, 0, 0]),  # prompts alone
        StageBatch.from_chains(["a", "b", "c", "d"], [ids(1), ids(2), ids(1), ids(90)], [33, 100, 70, 0]),
        StageBatch.from_chains(["a", "e"], [ids(1), ids(PREFILL_NEW_TOKENS[-1] + 1)], [34, 0]),  # too long
        StageBatch.from_chains(["b", "f"], [ids(1), ids(40)], [102, 0], last_logits_only=False),  # all logits
    ]
    for step, batch in enumerate(steps):
        want, got = run(eager, batch), run(static, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stats = [runner.stats for runner, _ in static]
    # the last stage runs the all-logits step eagerly; a stage before it hands on hidden states
    # and takes the buckets there too
    assert stats[-1] == {"eager": 2, "static": 3, "graph": 0, "captures": 0}, stats
    assert all(s == {"eager": 1, "static": 5, "graph": 0, "captures": 0} for s in stats[:-1]), stats
    assert 8 * PREFILL_NEW_TOKENS[-1] > MAX_PREFILL_ROWS  # wide batches of long prompts stay eager
