"""PEARL (``step.pearl``, ``engine.modes.pearl``): drafting ahead while the target verifies.

The bookkeeping (the trunk a step drafts ahead of, the drafts kept below the target's token)
and losslessness through the in-process engine for S = 1, 2, 3 stages: token-identical to HF
greedy with the target drafting for itself (every step after the first is post-verify), the
n-gram drafter (rejections: pre-verify steps), a drafter failing mid-request, a batch of
requests at once, and seeded sampling (the same text as plain sampling with that seed). One
real-model check (SmolLM2-135M, S = 2). The Ray path is in tests/runtime/test_pipedec_ray.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.verify import VerifyResult
from cosine_ray.algo.tree_selection import build_tree
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.modes.pearl import Pearl, after_token, trunk_tokens
from cosine_ray.engine.types import Drafted, Verified
from cosine_ray.engine.request import Request, SamplingParams
from support.factories import Clock
from support.hf_reference import hf_greedy

MAX_TOKENS = 30


def make_engine(ckpt, drafters: str, num_stages: int = 1, **step) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), num_stages=num_stages).replace(
            **{"pearl": "on", **step}), checkpoint=ckpt)


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


def path(tokens, confidences, owner="d") -> FusedPath:
    return FusedPath(tuple(tokens), tuple(confidences), (owner,) * len(tokens))


def verified(rid: str, accepted: tuple[int, ...], bonus: int) -> Verified:
    result = VerifyResult(tuple(range(1, len(accepted) + 1)), accepted, bonus)
    return Verified(rid, result.new_token_ids, (0,) + result.accepted_node_ids, result)


# ---- bookkeeping ------------------------------------------------------------------------------

def test_trunk_follows_the_most_likely_child():
    tree = build_tree(1, [path([5, 6, 7], [0.9, 0.5, 0.9]), path([5, 8], [0.9, 0.6]), path([9], [0.3])], 10)
    assert trunk_tokens(tree) == (5, 8)  # 0.9·0.6 beats 0.9·0.5; the 0.3 branch loses at depth 1
    assert trunk_tokens(build_tree(1, [], 4)) == ()


def test_after_token_keeps_the_subtree_below_the_target_token():
    drafted = Drafted([path([4, 5, 6], [0.9, 0.8, 0.7]), path([4, 7], [0.9, 0.2]), path([3, 2], [0.1, 0.1])],
                      {"d": [(4, 0.9), (5, 0.8)], "e": [(3, 0.1)]}, (4, 5, 6))
    below = after_token(drafted, 4)
    assert [p.token_ids for p in below.paths] == [(5, 6), (7,)]
    assert below.paths[0].confidences == (0.8, 0.7)
    assert below.answers == {"d": [(5, 0.8)]} and below.trunk == (5, 6)
    assert after_token(drafted, 9) is None


def test_keep_only_when_the_whole_trunk_is_accepted():
    """Request at 5 tokens; the step verifies trunk (5, 6) and drafted ahead from it."""
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=50))
    r.output_token_ids = [4, 9]
    ahead = {"r": Drafted([path([8, 1, 2], [0.9, 0.9, 0.9])])}
    pearl = Pearl()
    pearl.keep([r], {"r": (5, 6)}, ahead, [verified("r", (5,), 8)])  # 6 rejected
    assert pearl.take([r]) == {}
    pearl.keep([r], {"r": (5, 6)}, ahead, [verified("r", (5, 6), 7)])  # all, but 7 is not drafted
    assert pearl.take([r]) == {}
    pearl.keep([r], {"r": (5, 6)}, ahead, [Verified("r", (5, 6, 8), (0, 1, 2))])  # a prefill: not a tree
    assert pearl.take([r]) == {}
    pearl.keep([r], {"r": (5, 6)}, ahead, [verified("r", (5, 6), 8)])  # all, and 8 heads a path
    r.output_token_ids += [5, 6, 8]
    kept = pearl.take([r])
    assert [p.token_ids for p in kept["r"].paths] == [(1, 2)]
    assert pearl.take([r]) == {}  # taken once
    assert (pearl.stats.steps, pearl.stats.post_verify) == (5, 1)
    pearl.keep([r], {"r": ()}, {"r": Drafted([path([3, 1], [0.5, 0.5])])}, [verified("r", (), 3)])
    r.output_token_ids += [7]  # the request moved on some other way: the drafts no longer apply
    assert pearl.take([r]) == {}


# ---- lossless through the engine --------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_self_drafting_is_post_verify_after_the_first_step(tiny_checkpoint, prompts, reference, num_stages):
    """The target drafting for itself is always right, so every step after a request's first
    decode step verifies a tree drafted during the previous verification."""
    engine = make_engine(tiny_checkpoint, "self", num_stages, num_speculative_tokens=4)
    # the speculation guard's exploring steps may run at κ = 0 (nothing drafted, so nothing
    # drafted ahead): held at its level here, as this is about PEARL's chain of trees
    guard = engine.core.scheduler.guard
    guard.explore_share = guard.young_explore_share = 0.0
    outs = [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0] for p in prompts]
    assert [o.new_token_ids for o in outs] == reference
    stats = engine.core.pearl.stats
    assert stats.pre_verify == len(prompts)  # one each: the first decode step
    assert stats.post_verify == stats.steps - len(prompts) > 0
    for o in outs:  # every tree drafted ahead was accepted whole
        assert o.stats.num_accepted_tokens == o.stats.num_draft_tokens > 0
    series = {dict(labels)["kind"]: n for labels, n in engine.core.metrics.snapshot()["cosine_ray:pearl_steps"].items()}
    assert series == {"post_verify": stats.post_verify, "pre_verify": stats.pre_verify}  # the metric counts them


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_ngram_drafting_equals_hf_greedy(tiny_checkpoint, prompts, reference, num_stages):
    """Mostly rejections (pre-verify steps), some runs on the repetitive prompt, all at once."""
    engine = make_engine(tiny_checkpoint, "ngram", num_stages)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == reference
    stats = engine.core.pearl.stats
    assert stats.pre_verify > 0 and stats.post_verify > 0


class FailingAfter:
    """A drafter client that answers ``good`` calls, then raises (a lost drafter actor)."""

    def __init__(self, inner, good: int) -> None:
        self.inner, self.good, self.calls = inner, good, 0
        self.name, self.learns = inner.name, inner.learns

    def _call(self):
        self.calls += 1
        if self.calls > self.good:
            raise RuntimeError("drafter lost")

    async def continue_chains(self, queries):
        self._call()
        return await self.inner.continue_chains(queries)

    async def continue_drafts(self, queries):
        self._call()
        return await self.inner.continue_drafts(queries)


def test_fused_drafters_and_a_failing_one_change_nothing(tiny_checkpoint, prompts, reference):
    """Two drafters fused per request; the target's own drafter dies after a few calls."""
    engine = make_engine(tiny_checkpoint, "self,ngram", 2, drafters_per_request=2)
    clients = engine.core.speculator.drafting.clients
    flaky = clients["self"] = FailingAfter(clients["self"], good=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == reference
    assert flaky.calls > flaky.good and engine.core.exporter.drafter_failures().get("self", 0) > 0
    assert engine.core.pearl.stats.post_verify > 0


@pytest.mark.parametrize("num_stages", [1, 3])
def test_seeded_sampling_is_plain_sampling(tiny_checkpoint, prompts, num_stages):
    """A seeded request's text is what plain sampling (no drafters) draws with that seed."""
    plain = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("none")),
                        checkpoint=tiny_checkpoint)
    engine = make_engine(tiny_checkpoint, "self,ngram", num_stages)
    for seed in range(3):
        params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed)
        want = [o.new_token_ids for o in plain.generate(prompts[:3], params)]
        assert [o.new_token_ids for o in engine.generate(prompts[:3], params)] == want, f"seed {seed}"


@pytest.mark.real_model
def test_real_model_pearl_equals_hf_greedy(real_checkpoint, real_hf_model):
    """SmolLM2-135M, S = 2, the default drafters: token-identical to HF greedy (fp32)."""
    tokenizer = real_checkpoint.load_tokenizer()
    texts = ["Write a Python function that returns the factorial of n.", "What is 17 times 23?"]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    engine = LocalEngine(EngineConfig(num_stages=2, weights="dense").replace(pearl="auto"), checkpoint=real_checkpoint)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    refs = [hf_greedy(real_hf_model, p, 40) for p in prompts]
    for o, ref in zip(outs, refs):
        assert o.new_token_ids == ref[:len(o.new_token_ids)] and (len(o.new_token_ids) == 40 or o.finish_reason == "stop")
    assert engine.core.pearl.stats.post_verify > 0


# ---- auto: pre-verify only while drafting is the slower ----------------------------------------

def test_auto_pre_verifies_only_while_drafting_is_slower():
    pearl = Pearl("auto")
    assert pearl.pre_verify()  # unmeasured: the paper's rule
    pearl.observe(0.001, 0.050)
    assert not pearl.pre_verify()  # drafting 1 ms, verifying 50 ms: draft first
    for _ in range(20):
        pearl.observe(0.080, 0.050)
    assert pearl.pre_verify()  # drafting now takes longer than verification
    pearl.observe(None, 0.050)  # a step that drafted nothing leaves the drafting time alone
    assert pearl.draft_s > 0.05
    assert Pearl("on").pre_verify()


class SlowDrafter:
    """A drafter client whose every call takes ``delay_s`` on ``clock`` (a model drafter across a link)."""

    def __init__(self, inner, delay_s: float, clock: Clock) -> None:
        self.inner, self.delay_s, self.clock = inner, delay_s, clock
        self.name, self.learns = inner.name, inner.learns

    async def continue_chains(self, queries):
        self.clock.now += self.delay_s
        await asyncio.sleep(0)
        return await self.inner.continue_chains(queries)

    async def continue_drafts(self, queries):
        self.clock.now += self.delay_s
        await asyncio.sleep(0)
        return await self.inner.continue_drafts(queries)


class SlowTarget:
    """The verifier's target whose every scoring call takes ``delay_s`` on ``clock`` (a big target)."""

    def __init__(self, inner, delay_s: float, clock: Clock) -> None:
        self.inner, self.delay_s, self.clock = inner, delay_s, clock

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def score(self, items):
        self.clock.now += self.delay_s
        await asyncio.sleep(0)
        return await self.inner.score(items)


@pytest.mark.parametrize("draft_delay_s, verify_delay_s, pre_verifies", [(0.0, 0.05, False), (0.05, 0.01, True)])
def test_auto_follows_the_measured_times(tiny_checkpoint, prompts, reference, draft_delay_s, verify_delay_s,
                                         pre_verifies):
    """Lookup drafting (no time) next to a target taking 50 ms a forward: requests with nothing
    drafted ahead draft first. A drafter taking 50 ms a call next to a 10 ms forward: they
    pre-verify. Times are read from clocks only the drafter and the target move."""
    engine = make_engine(tiny_checkpoint, "ngram", 1, pearl="auto")
    draft_clock, verify_clock = Clock(), Clock()
    engine.core.clock = draft_clock  # times the drafting done ahead
    clients = engine.core.speculator.drafting.clients
    clients["ngram"] = SlowDrafter(clients["ngram"], draft_delay_s, draft_clock)
    verifier = engine.core.verifier
    verifier.clock = verify_clock
    verifier.target = SlowTarget(verifier.target, verify_delay_s, verify_clock)
    outs = [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0] for p in prompts]
    assert [o.new_token_ids for o in outs] == reference
    pearl = engine.core.pearl
    assert (pearl.draft_s, pearl.verify_s) == pytest.approx((draft_delay_s, verify_delay_s))
    stats = pearl.stats
    if pre_verifies:
        assert stats.pre_verify > 0 and stats.drafted_first == 0
    else:
        assert stats.drafted_first > 0 and stats.pre_verify == 1  # only before the first measurement
