"""PipeDec mode (``--pipeline-mode pipedec``, ``engine.modes.pipedec``): the prediction tree's
bookkeeping, and losslessness through the in-process engine for S = 1, 2, 3 stages.

Tiny random model (no near-ties: exact comparison with HF greedy) for every drafter path: the
target drafting for itself (every timestep a hit), the n-gram drafter (mostly misses), a
drafter that fails mid-request, requests arriving while one runs alone (the engine leaves
PipeDec and comes back), seeded sampling (the same text as plain sampling with that seed,
for every seed), and sampled sequences against the target's exact distribution (chi-square).
One real-model check (SmolLM2-135M).
The Ray stage actors' path is in tests/runtime/test_pipedec_ray.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, SpeculationConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.modes.pipedec import ModeGuard, PipeDecSession
from cosine_ray.engine.request import Request, SamplingParams
from support.hf_reference import hf_greedy

MAX_TOKENS = 30


def make_engine(ckpt, drafters: str, num_stages: int, **step) -> LocalEngine:
    """PipeDec without the mode guard unless asked (the tests below are about PipeDec itself)."""
    step = {"pipedec_guard": False, **step}
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), num_stages=num_stages).replace(
            pipeline_mode="pipedec", **step), checkpoint=ckpt)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20)] + [list(range(10, 22)) * 3]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, prompts) -> list[list[int]]:
    hf = tiny_checkpoint.load_hf_model()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert all(len(r) == MAX_TOKENS for r in refs)
    return refs


def generate_alone(engine: LocalEngine, prompts, params) -> list:
    """One request at a time: each runs alone in the pool (PipeDec's case)."""
    return [engine.generate([p], params)[0] for p in prompts]


# ---- the tree's bookkeeping ---------------------------------------------------------------------

def test_session_layers_prunes_and_commits():
    """Two stages; the root (token 4 at position 3) gets children 7 and 8, 8 a child 9. Each
    stage's prune lists its committed old roots first, then its live nodes, as slots of its
    own speculative level; every node attends to its live ancestors' slots."""
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10))
    request.output_token_ids = [4]
    s = PipeDecSession(request, num_stages=2, drafters=("d",))
    root = s.root
    t1 = s.layer_items()
    assert t1[1] is None and t1[0].token_ids == (4,) and t1[0].positions == (3,) and t1[0].ancestors == ((),)
    assert t1[0].keep is None
    c7 = s._add(7, root, 4, 0.9)
    c8 = s._add(8, root, 4, 0.5)
    t2 = s.layer_items()  # stage 0: the children; stage 1: the root
    assert t2[0].token_ids == (7, 8) and t2[0].ancestors == ((0,), (0,)) and t2[0].positions == (4, 4)
    assert t2[1].token_ids == (4,) and t2[1].rows is None and t2[1].ancestors == ((),)
    g9 = s._add(9, c8, 5, 0.4)
    assert s.path(g9) == (8, 9) and s.ancestors(g9) == [c8, root]

    assert s.accept(8) is True  # the root's logits said 8: a hit, the tree is 8's subtree
    assert s.root == c8 and set(s.nodes) == {c8, g9}
    t3 = s.layer_items()
    # stage 0 held [4, 7, 8]: commit 4, keep 8; then 9 attends to 8 (now slot 0)
    assert (t3[0].keep, t3[0].num_committed) == ((0, 2), 1)
    assert t3[0].token_ids == (9,) and t3[0].ancestors == ((0,),)
    # stage 1 held [4]: commit it; its input rows are [7, 8] of which 8 survives
    assert (t3[1].keep, t3[1].num_committed) == ((0,), 1)
    assert t3[1].token_ids == (8,) and t3[1].rows == (1,) and t3[1].ancestors == ((),)

    assert s.accept(5) is False  # 8's logits said 5: a miss, the tree restarts from 5
    assert [n.token for n in s.nodes.values()] == [5] and s.nodes[s.root].position == 5
    t4 = s.layer_items()
    assert t4[0].token_ids == (5,) and (t4[0].keep, t4[0].num_committed) == ((0,), 1)  # commit 8, drop 9
    assert t4[1] is None  # 9 was pruned: stage 1 idles (and syncs later)
    assert s.leave() == [((), 0), ((0,), 1)]  # stage 0 drops the root 5; stage 1 commits 8
    assert s.committed == []
    _ = c7


# ---- lossless, in-process -----------------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_self_drafting_hits_every_timestep_and_equals_hf_greedy(tiny_checkpoint, prompts, reference, num_stages):
    """The target drafting for itself is always right: with width 1 the tree is a chain of
    its first choices, so after the pipeline fills every timestep commits a token (the hit
    path: prune to the child's subtree, commit old roots). (Wider, a deep node on the path
    may lose its slot in the layer to a sibling's child with a higher cumulative confidence.)"""
    engine = make_engine(tiny_checkpoint, "self", num_stages, pipedec_width=1)
    outs = generate_alone(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == reference
    for o in outs:
        assert o.stats.num_verify_steps == 0  # every token came from PipeDec
        # the first token is the prefill's; every later one was in the tree (drafted while the
        # root went through the stages), and only the first S-1 timesteps commit nothing
        assert o.stats.pipedec_hits == MAX_TOKENS - 1
        assert o.stats.pipedec_timesteps == (MAX_TOKENS - 1) + (num_stages - 1)
    assert engine.target.num_cached_requests() == 0


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_ngram_drafting_misses_and_equals_hf_greedy(tiny_checkpoint, prompts, reference, num_stages):
    """Mostly misses (the miss path: restart from the target's token) and some hits on the
    repetitive prompt; width 2, depth 2."""
    engine = make_engine(tiny_checkpoint, "ngram", num_stages, pipedec_width=2, pipedec_depth=2)
    outs = generate_alone(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == reference
    timesteps = sum(o.stats.pipedec_timesteps for o in outs)
    hits = sum(o.stats.pipedec_hits for o in outs)
    assert 0 < hits < sum(MAX_TOKENS - 1 for _ in outs) <= timesteps
    assert engine.target.num_cached_requests() == 0


class FlakyClient:
    """Wraps a drafter client; every call after the first ``good`` ones raises."""

    def __init__(self, inner, good: int) -> None:
        self.inner, self.good, self.calls = inner, good, 0
        self.name, self.learns = inner.name, inner.learns

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def continue_drafts(self, queries):
        self.calls += 1
        if self.calls > self.good:
            raise RuntimeError("drafter lost")
        return await self.inner.continue_drafts(queries)


def test_a_drafter_failing_mid_request_changes_nothing(tiny_checkpoint, prompts, reference):
    engine = make_engine(tiny_checkpoint, "self,ngram", 2)
    flaky = FlakyClient(engine.core.pipedec.clients["self"], good=6)
    engine.core.pipedec.clients["self"] = flaky
    outs = generate_alone(engine, prompts[:2], SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == reference[:2]
    assert flaky.calls > flaky.good and engine.core.exporter.drafter_failures().get("self", 0) > 0
    assert outs[0].stats.pipedec_hits >= 5  # the drafter was right while it lived


@pytest.mark.parametrize("num_stages, num_lanes", [(2, 1), (3, 1), (2, 2), (3, 3)])
def test_requests_arriving_while_one_runs_alone(tiny_checkpoint, prompts, reference, num_stages, num_lanes):
    """The first request starts alone (PipeDec); the others arrive mid-request: the engine
    leaves PipeDec (every stage keeps only what was committed), runs lanes, and the last one
    left comes back to PipeDec. With several lanes, another lane's steps run while a timestep
    is in flight and must not end the session under it. Text unchanged, no KV left."""
    engine = make_engine(tiny_checkpoint, "self,ngram", num_stages, num_speculative_tokens=4,
                         min_tree_confidence=0.0, adaptive=False, num_lanes=num_lanes)

    async def main():
        # request i > 0 arrives once the first has streamed 5 + 5·i of its MAX_TOKENS + 10 tokens
        arrive = {i: asyncio.Event() for i in range(1, len(prompts))}

        async def one(i, prompt):
            if i:
                await arrive[i].wait()
            tokens, last = [], None
            try:
                async for out in engine.stream(prompt, SamplingParams(max_tokens=MAX_TOKENS + 10 * (i == 0))):
                    tokens += out.new_token_ids
                    last = out
                    for j in arrive if i == 0 else ():
                        if len(tokens) >= 5 + 5 * j:
                            arrive[j].set()
            finally:
                if i == 0:  # never leave the others waiting
                    for event in arrive.values():
                        event.set()
            return tokens, last.stats

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.loop.shutdown()

    results = asyncio.run(main())
    hf = tiny_checkpoint.load_hf_model()
    assert results[0][0] == hf_greedy(hf, prompts[0], MAX_TOKENS + 10)
    assert [r[0] for r in results[1:]] == reference[1:]
    stats = [s for _, s in results]
    assert stats[0].pipedec_timesteps > 0 and stats[0].num_verify_steps > 0  # both modes ran
    assert sum(s.pipedec_timesteps for s in stats[1:]) + stats[0].pipedec_timesteps > 0
    assert engine.target.num_cached_requests() == 0 and engine.core.pipedec.session is None


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_seeded_sampling_is_plain_sampling(tiny_checkpoint, prompts, num_stages):
    """A seeded request's text is exactly what plain sampling (no drafters, no PipeDec) draws
    with that seed, for every seed: PipeDec samples the target's distribution (the keyed
    Gumbel race of ``algo.sampling``, whose distribution tests are in tests/algo)."""
    plain = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("none")),
                        checkpoint=tiny_checkpoint)
    engine = make_engine(tiny_checkpoint, "self,ngram", num_stages)
    for seed in range(4):
        params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed)
        want = [o.new_token_ids for o in generate_alone(plain, prompts[:2], params)]
        outs = generate_alone(engine, prompts[:2], params)
        assert [o.new_token_ids for o in outs] == want, f"seed {seed}"
        assert all(o.stats.pipedec_timesteps > 0 for o in outs)


def test_mode_guard_explores_keeps_the_faster_and_probes_again():
    guard = ModeGuard(window_tokens=10, reprobe_tokens=40)
    assert guard.current == "pipedec"
    guard.record("lanes", 50, 1.0)  # not the current mode: ignored
    guard.record("pipedec", 6, 1.0)
    assert guard.current == "pipedec" and guard.rates["pipedec"] is None  # window not full yet
    guard.record("pipedec", 4, 1.0)  # 10 tokens in 2 s: 5 tok/s, then lanes is explored
    assert guard.rates["pipedec"] == 5.0 and guard.current == "lanes"
    guard.record("lanes", 10, 1.0)  # 10 tok/s: lanes is faster and stays
    assert guard.rates["lanes"] == 10.0 and guard.current == "lanes"
    for _ in range(2):
        guard.record("lanes", 10, 1.0)
    assert guard.current == "lanes"
    guard.record("lanes", 10, 1.0)  # 40 tokens since the last probe: PipeDec once more
    assert guard.current == "pipedec"
    guard.record("pipedec", 10, 0.5)  # 20 tok/s now: averaged with the old 5 -> 12.5 > 10
    assert guard.rates["pipedec"] == 12.5 and guard.current == "pipedec"


def test_engine_with_the_guard_runs_both_modes_and_stays_lossless(tiny_checkpoint, prompts):
    """The guard (on by default) tries PipeDec, then lanes, then keeps one: a long request
    runs in both modes, switching between them, and its text is HF greedy."""
    hf = tiny_checkpoint.load_hf_model()
    engine = make_engine(tiny_checkpoint, "self,ngram", 2, pipedec_guard=True, num_speculative_tokens=4,
                         min_tree_confidence=0.0, adaptive=False)
    out = engine.generate([prompts[3]], SamplingParams(max_tokens=120))[0]
    assert out.new_token_ids == hf_greedy(hf, prompts[3], 120)
    assert out.stats.pipedec_tokens >= 32 and out.stats.num_verify_steps > 0
    guard = engine.core.mode_guard
    assert guard.rates["pipedec"] is not None and guard.rates["lanes"] is not None
    assert engine.target.num_cached_requests() == 0


def test_pipedec_needs_a_pipeline_target():
    with pytest.raises(ValueError, match="pipeline_mode"):
        SpeculationConfig(pipeline_mode="tree")
    with pytest.raises(ValueError, match="pipedec_width"):
        SpeculationConfig(pipedec_width=0)


@pytest.mark.real_model
def test_real_model_pipedec_equals_hf_greedy(real_checkpoint, real_hf_model):
    """SmolLM2-135M, S = 2, the default drafters: token-identical to HF greedy (fp32)."""
    tokenizer = real_checkpoint.load_tokenizer()
    texts = ["Write a Python function that returns the factorial of n.", "What is 17 times 23?"]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    engine = LocalEngine(EngineConfig(num_stages=2, weights="dense").replace(pipeline_mode="pipedec"),
                         checkpoint=real_checkpoint)
    outs = generate_alone(engine, prompts, SamplingParams(max_tokens=40))
    refs = [hf_greedy(real_hf_model, p, 40) for p in prompts]
    for o, ref in zip(outs, refs):
        assert o.new_token_ids == ref[:len(o.new_token_ids)] and (len(o.new_token_ids) == 40 or o.finish_reason == "stop")
    assert sum(o.stats.pipedec_hits for o in outs) > 0


@pytest.mark.full  # a statistical sweep
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 3, 1.0), (0.7, 4, 0.9)])
def test_sampled_sequences_follow_the_target_distribution(tiny_checkpoint, temperature, top_k, top_p):
    """PipeDec's sampling against the exact (filtered) target distribution, chi-square: many
    seeded 3-token requests, each alone at S = 2 (so every token after the first is a
    PipeDec timestep: hits when a drafter's token is the sampled one, misses otherwise)."""
    from collections import Counter

    from scipy.stats import chisquare

    from cosine_ray.algo.sampling import logits_to_probs

    n_requests, prompt = 600, [5, 17, 42]
    engine = make_engine(tiny_checkpoint, "self,ngram", 2, pipedec_width=2)
    outs = [engine.generate([prompt], SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k,
                                                     top_p=top_p, seed=i))[0]
            for i in range(n_requests)]
    observed = Counter(tuple(o.new_token_ids) for o in outs)
    assert sum(o.stats.pipedec_timesteps for o in outs) >= 2 * n_requests
    assert 0 < sum(o.stats.pipedec_hits for o in outs) < sum(o.stats.pipedec_tokens for o in outs)

    hf = tiny_checkpoint.load_hf_model()

    @torch.no_grad()
    def probs(context):
        logits = hf(torch.tensor([context])).logits[0, -1:].float()
        return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)[0].double()

    expected = {}
    p0 = probs(prompt)
    for a in torch.nonzero(p0).flatten().tolist():
        p1 = probs(prompt + [a])
        for b in torch.nonzero(p1).flatten().tolist():
            p2 = probs(prompt + [a, b])
            for c in torch.nonzero(p2).flatten().tolist():
                expected[(a, b, c)] = float(p0[a] * p1[b] * p2[c]) * n_requests
    assert not set(observed) - set(expected)  # never a filtered-out token
    big = [k for k, e in expected.items() if e >= 5]
    assert len(big) >= 8
    obs = [observed[k] for k in big] + [n_requests - sum(observed[k] for k in big)]
    exp = [expected[k] for k in big] + [n_requests - sum(expected[k] for k in big)]
    assert chisquare(obs, exp).pvalue > 1e-3
