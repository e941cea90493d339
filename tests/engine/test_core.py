"""The engine core's plumbing with fakes: a lookup-table target that checks the KV protocol, and drafters
that are perfect, wrong, malformed, failing or hanging. Text never depends on the drafters."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import pytest
import torch

from cosine_ray.algo.sampling import logits_to_probs
from cosine_ray.engine.drafters.base import DraftProposal
from cosine_ray.engine.drafters.models.model import ModelDrafter
from cosine_ray.engine.drafters.lookup.ngram import NgramDrafter
from cosine_ray.models.loader import build_stages
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.clients import LocalDrafterClient
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.engine.worker.clients import LocalTargetClient
from cosine_ray.models.llama import LlamaStage, StageBatch

from support.factories import engine_config
from support.fakes import (VOCAB, PROMPTS, AdversarialDrafter, drain, FakeDrafter, GarbageDrafter,  # noqa: E402
                           HangingDrafter, OracleDrafter, RaisingDrafter, TableTarget)


# ---- helpers ---------------------------------------------------------------------------------

CLASSIC = dict(fusion="union", scheduler="fcfs", adaptive=False, drafters_per_request=3)
"""Plain speculative decoding (every drafter's whole paths, fixed γ, first-come batches): the
plumbing these tests pin down exactly. CoSine's own path is tested in test_cosine_core.py."""


def make_core(target, drafters=(), *, eos=(), vocab=VOCAB, **config) -> EngineCore:
    return EngineCore(engine_config(**{**CLASSIC, **config}), target, list(drafters), vocab_size=vocab, eos_token_ids=eos)


def run_batch(target, drafters, prompts=PROMPTS, params=SamplingParams(max_tokens=21), **config):
    core = make_core(target, drafters, **config)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    tokens, finals = asyncio.run(drain(core))
    return core, [tokens[f"r{i}"] for i in range(len(prompts))], [finals[f"r{i}"] for i in range(len(prompts))]


def reference(target, prompts=PROMPTS, max_tokens=21, stops=()):
    return [target.greedy(p, max_tokens, stops) for p in prompts]


# ---- greedy output never depends on the drafters ---------------------------------------------

@pytest.mark.parametrize("gamma", [1, 4])
def test_no_drafters_is_plain_greedy(gamma):
    target = TableTarget()
    core, out, finals = run_batch(target, [], num_speculative_tokens=gamma)
    assert out == reference(target)
    for f in finals:
        assert f.finish_reason == "length" and f.num_output_tokens == 21
        assert f.stats.num_draft_tokens == 0 and f.stats.num_verify_steps == 20
    assert target.committed == {} and sorted(target.released) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("gamma", [1, 4, 6])
def test_oracle_drafter_accepts_whole_budget(gamma):
    target = TableTarget()
    oracle = OracleDrafter("oracle", target)
    max_tokens = 1 + 4 * (gamma + 1)  # every verify step has the full budget
    core, out, finals = run_batch(target, [oracle], params=SamplingParams(max_tokens=max_tokens),
                                    num_speculative_tokens=gamma)
    assert out == reference(target, max_tokens=max_tokens)
    for f in finals:
        assert f.stats.num_verify_steps == 4
        assert f.stats.mean_accepted_length == gamma + 1
        assert f.stats.num_accepted_tokens == f.stats.num_draft_tokens == 4 * gamma
        assert f.stats.drafted_by == f.stats.accepted_by == {"oracle": 4 * gamma}
    # feedback: every verify step told the drafter its drafts were all accepted
    assert len(oracle.observed) == 3 * 4
    assert all(fb.num_draft_tokens == fb.num_accepted_tokens == gamma for fb in oracle.observed)
    assert core.exporter.drafter_failures() == {}


def test_oracle_budget_shrinks_near_max_tokens():
    target = TableTarget()
    oracle = OracleDrafter("oracle", target)
    core, out, finals = run_batch(target, [oracle], params=SamplingParams(max_tokens=8),
                                    num_speculative_tokens=4)
    assert out == reference(target, max_tokens=8)
    # after prefill: 1 token; step 1 drafts 4 (+bonus) -> 6; step 2 may only draft 1 -> 8
    assert all(f.stats.num_verify_steps == 2 and f.stats.num_draft_tokens == 5 for f in finals)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_adversarial_drafter_changes_nothing(gamma):
    target = TableTarget()
    adversary = AdversarialDrafter("adversary", target)
    core, out, finals = run_batch(target, [adversary], num_speculative_tokens=gamma)
    assert out == reference(target)
    for f in finals:
        assert f.stats.num_draft_tokens > 0 and f.stats.num_accepted_tokens == 0
        assert f.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("kind", GarbageDrafter.PER_ITEM)
def test_malformed_proposals_are_dropped_and_counted(kind):
    target = TableTarget()
    garbage = GarbageDrafter(kind, target)
    core, out, finals = run_batch(target, [garbage], num_speculative_tokens=4)
    assert out == reference(target)
    assert all(kind not in f.stats.drafted_by and f.stats.num_draft_tokens == 0 for f in finals)
    assert garbage.num_inputs > 0
    assert core.exporter.drafter_failures() == {kind: garbage.num_inputs}


@pytest.mark.parametrize("kind", GarbageDrafter.WHOLE_CALL)
def test_malformed_answers_are_dropped_and_counted(kind):
    target = TableTarget()
    garbage = GarbageDrafter(kind, target)
    core, out, finals = run_batch(target, [garbage], num_speculative_tokens=4)
    assert out == reference(target)
    assert all(f.stats.num_draft_tokens == 0 for f in finals)
    assert core.exporter.drafter_failures() == {kind: garbage.num_calls} and garbage.num_calls == 19


def test_raising_drafter_is_dropped_and_counted():
    target = TableTarget()
    raising = RaisingDrafter()
    core, out, finals = run_batch(target, [raising], num_speculative_tokens=4)
    assert out == reference(target)
    # 20 verify steps, the last with no budget left (max_tokens): 19 proposes failed, observe
    # (every drafter hears about every verify) failed 20 times, and the three requests finished
    # together, so one release call failed
    assert raising.num_calls == 19
    assert core.exporter.drafter_failures() == {"raising": 19 + 20 + 1}


def test_raising_observe_is_counted_and_harmless():
    target = TableTarget()
    drafter = RaisingDrafter("flaky", on=("observe",))
    core, out, _ = run_batch(target, [drafter, OracleDrafter("oracle", target)], num_speculative_tokens=2)
    assert out == reference(target)
    assert core.exporter.drafter_failures()["flaky"] > 0
    assert sorted(drafter.released) == ["r0", "r1", "r2"]


def test_hanging_drafter_misses_its_deadline():
    target = TableTarget()
    hanging = HangingDrafter(seconds=30.0)
    params = SamplingParams(max_tokens=6)
    t0 = time.monotonic()
    core, out, finals = run_batch(target, [hanging], params=params, num_speculative_tokens=4,
                                    drafter_deadline_s=0.05)
    assert time.monotonic() - t0 < 5.0
    assert out == reference(target, max_tokens=6)
    assert all(f.finish_reason == "length" for f in finals)
    assert core.exporter.drafter_failures() == {"hanging": hanging.num_calls} and hanging.num_calls == 4


def test_good_drafter_keeps_working_beside_bad_ones():
    target = TableTarget()
    bad = [HangingDrafter(seconds=30.0), RaisingDrafter(), GarbageDrafter("over_budget", target),
           GarbageDrafter("not_a_list", target), AdversarialDrafter("adversary", target)]
    drafters = [*bad[:2], OracleDrafter("oracle", target), *bad[2:]]
    core, out, finals = run_batch(target, drafters, params=SamplingParams(max_tokens=16),
                                    num_speculative_tokens=4, drafter_deadline_s=0.05)
    assert out == reference(target, max_tokens=16)
    for f in finals:  # the adversary's nodes compete for the budget, yet the oracle path wins
        assert f.stats.accepted_by == {"oracle": f.stats.num_accepted_tokens}
        assert f.stats.num_accepted_tokens > 0
    failures = core.exporter.drafter_failures()
    assert set(failures) == {"hanging", "raising", "over_budget", "not_a_list"}


def test_accepted_path_behind_rejected_branches_is_committed():
    """The adversary's nodes come first in the tree, so the accepted (oracle) path is not the
    node prefix 0, 1, 2, ...: commit_previous must name the real path (the table target
    asserts it is a root path of the scored tree) and the text stays greedy."""
    target = TableTarget()
    drafters = [AdversarialDrafter("adversary", target, confidence=0.3), OracleDrafter("oracle", target, max_len=4)]
    core, out, finals = run_batch(target, drafters, num_speculative_tokens=6)
    assert out == reference(target)
    for f in finals:
        assert f.stats.drafted_by["adversary"] > 0 and f.stats.accepted_by == {"oracle": f.stats.num_accepted_tokens}
        assert f.stats.num_accepted_tokens > f.stats.num_verify_steps  # > 1 accepted per step


def test_zero_budget_never_calls_drafters():
    target = TableTarget()
    oracle = OracleDrafter("oracle", target)
    core, out, finals = run_batch(target, [oracle], num_speculative_tokens=0)
    assert out == reference(target)
    assert oracle.num_calls == 0 and all(f.stats.num_draft_tokens == 0 for f in finals)
    core, out, finals = run_batch(target, [oracle], params=SamplingParams(max_tokens=1))
    assert out == reference(target, max_tokens=1) and oracle.num_calls == 0


# ---- stopping --------------------------------------------------------------------------------

def test_max_tokens_stop_per_request():
    target = TableTarget()
    params = [SamplingParams(max_tokens=n) for n in (1, 7, 13)]
    core = make_core(target, [OracleDrafter("oracle", target)], num_speculative_tokens=5)
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        core.add_request(f"r{i}", p, sp)
    tokens, finals = asyncio.run(drain(core))
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        assert tokens[f"r{i}"] == target.greedy(p, sp.max_tokens)
        assert finals[f"r{i}"].finish_reason == "length"
        assert finals[f"r{i}"].num_output_tokens == sp.max_tokens


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_stop_token_ends_request_even_inside_accepted_drafts(how):
    target = TableTarget()
    ref = target.greedy(PROMPTS[0], 30)
    stop = ref[9]  # the oracle drafts past it; the suffix after it must be dropped
    first = ref.index(stop)
    eos = (stop,) if how == "eos" else ()
    params = SamplingParams(max_tokens=30, stop_token_ids=() if eos else (stop,))
    core = make_core(target, [OracleDrafter("oracle", target)], eos=eos, num_speculative_tokens=6)
    core.add_request("r0", PROMPTS[0], params)
    tokens, finals = asyncio.run(drain(core))
    assert tokens["r0"] == ref[:first + 1]
    assert finals["r0"].finish_reason == "stop"
    assert target.committed == {}


def test_ignore_eos():
    target = TableTarget()
    ref = target.greedy(PROMPTS[1], 12)
    core = make_core(target, [OracleDrafter("oracle", target)], eos=(ref[2],), num_speculative_tokens=3)
    core.add_request("r0", PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))
    tokens, finals = asyncio.run(drain(core))
    assert tokens["r0"] == ref and finals["r0"].finish_reason == "length"


# ---- continuous batching ---------------------------------------------------------------------

def test_requests_join_while_others_run():
    target = TableTarget()
    core = make_core(target, [OracleDrafter("oracle", target), AdversarialDrafter("adv", target)],
                         num_speculative_tokens=3)
    prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(5)}
    core.add_request("r0", prompts["r0"], SamplingParams(max_tokens=30))
    core.add_request("r1", prompts["r1"], SamplingParams(max_tokens=9))

    async def go():
        tokens: dict[str, list[int]] = defaultdict(list)
        for step in range(200):
            if step == 2:
                core.add_request("r2", prompts["r2"], SamplingParams(max_tokens=20))
            if step == 4:
                core.add_request("r3", prompts["r3"], SamplingParams(max_tokens=5))
                core.add_request("r4", prompts["r4"], SamplingParams(max_tokens=25))
            if step > 4 and not core.has_work:
                break
            for out in await core.step():
                tokens[out.request_id] += out.new_token_ids
        return tokens

    tokens = asyncio.run(go())
    limits = {"r0": 30, "r1": 9, "r2": 20, "r3": 5, "r4": 25}
    for rid, p in prompts.items():
        assert tokens[rid] == target.greedy(p, limits[rid]), rid
    assert max(target.batch_sizes) >= 3  # late arrivals ran together with r0
    assert target.committed == {} and not core.running and not core.waiting


def test_more_requests_than_max_batch_size():
    target = TableTarget()
    prompts = [[i, i + 1, (3 * i) % VOCAB] for i in range(7)]
    core, out, finals = run_batch(target, [OracleDrafter("oracle", target)], prompts=prompts,
                                    params=SamplingParams(max_tokens=10), num_speculative_tokens=2,
                                    max_num_seqs=3)
    assert out == reference(target, prompts, max_tokens=10)
    assert max(target.batch_sizes) == 3
    # FIFO admission: the first three requests were scored before any later one
    assert list(target.scored)[:3] == ["r0", "r1", "r2"]


def test_engine_loop_streams_late_arrivals():
    target = TableTarget()
    loop = EngineLoop(make_core(target, [OracleDrafter("oracle", target)], num_speculative_tokens=2))

    async def go():
        late = None
        tokens = []
        async for out in loop.generate(PROMPTS[0], SamplingParams(max_tokens=30), "first"):
            tokens += out.new_token_ids
            if late is None and len(tokens) >= 4:
                late = asyncio.create_task(loop.generate_all(PROMPTS[1], SamplingParams(max_tokens=12), "late"))
        late_out = await late
        await loop.shutdown()
        return tokens, late_out

    tokens, late_out = asyncio.run(go())
    assert tokens == target.greedy(PROMPTS[0], 30)
    assert late_out.new_token_ids == target.greedy(PROMPTS[1], 12) and late_out.finish_reason == "length"
    assert 2 in target.batch_sizes


# ---- validation ------------------------------------------------------------------------------

def test_add_request_validation():
    core = make_core(TableTarget(), max_model_len=20)
    core.add_request("a", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("a", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"\[0, 48\)"):
        core.add_request("b", [1, VOCAB], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"\[0, 48\)"):
        core.add_request("b", [-1], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds the model length 20"):
        core.add_request("b", [1] * 10, SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="at least one token"):
        core.add_request("b", [], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError):
        engine_config(max_num_seqs=0)
    with pytest.raises(ValueError):
        engine_config(num_speculative_tokens=-1)
    with pytest.raises(ValueError):
        engine_config(drafter_deadline_s=0)
    assert asyncio.run(make_core(TableTarget()).step()) == []


# ---- sampling --------------------------------------------------------------------------------

def test_sampled_request_is_deterministic_for_a_seed():
    def sample_run(seed, drafters_fn):
        target = TableTarget(scale=1.0)  # flat enough that samples differ from greedy
        params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=seed + i) for i in range(3)]
        core = make_core(target, drafters_fn(target), num_speculative_tokens=3)
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            core.add_request(f"r{i}", p, sp)
        tokens, _ = asyncio.run(drain(core))
        return [tokens[f"r{i}"] for i in range(3)]

    for drafters_fn in (lambda t: [], lambda t: [OracleDrafter("oracle", t), AdversarialDrafter("adv", t)]):
        a = sample_run(1234, drafters_fn)
        assert a == sample_run(1234, drafters_fn)
        assert a != sample_run(99, drafters_fn)
    assert sample_run(1234, lambda t: []) != reference(TableTarget(scale=1.0), max_tokens=24)


def test_top_k_one_sampling_is_greedy():
    target = TableTarget()
    core, out, _ = run_batch(target, [OracleDrafter("oracle", target), AdversarialDrafter("adv", target)],
                               params=SamplingParams(max_tokens=15, temperature=1.3, top_k=1, seed=5),
                               num_speculative_tokens=3)
    assert out == reference(target, max_tokens=15)


class RandomTreeDrafter(FakeDrafter):
    """Random (seeded) branching drafts: what verification sees from a mixed, noisy tree."""

    def __init__(self, name, vocab, seed=0):
        super().__init__(name)
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(seed)

    def draft(self, item):
        budget = item.max_draft_tokens
        paths = []
        while sum(len(p) for p in paths) < budget:
            n = min(budget - sum(len(p) for p in paths), int(torch.randint(1, 3, (1,), generator=self.g)))
            paths.append(torch.randint(0, self.vocab, (n,), generator=self.g).tolist())
        return DraftProposal(item.request_id, paths, [[0.5] * len(p) for p in paths])


@pytest.mark.full  # a statistical sweep
@pytest.mark.parametrize("temperature, top_k, top_p, pearl", [(1.0, 0, 1.0, "off"), (0.7, 3, 0.9, "off"),
                                                               (1.0, 0, 1.0, "on"), (0.7, 3, 0.9, "on")])
def test_sampled_sequences_follow_the_target_distribution(temperature, top_k, top_p, pearl):
    """Lossless through the whole loop: 3-token outputs of many seeded requests, drafted by
    random trees, against the exact (filtered) target distribution (chi-square); also with
    PEARL, whose trees were drafted during the previous verification."""
    from scipy.stats import chisquare

    vocab, n_requests = 5, 3000
    target = TableTarget(vocab=vocab, scale=1.0, seed=3)
    prompt = [1, 2]
    core = make_core(target, [RandomTreeDrafter("random", vocab)], vocab=vocab,
                         num_speculative_tokens=3, max_num_seqs=512, pearl=pearl)
    for i in range(n_requests):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, temperature=temperature,
                                                           top_k=top_k, top_p=top_p, seed=i))
    tokens, _ = asyncio.run(drain(core))
    observed = Counter(tuple(t) for t in tokens.values())

    def probs(context):
        logits = target.logits(context)[None]
        return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)[0].double()

    expected = {}
    for a in range(vocab):
        pa = probs(prompt)[a]
        for b in range(vocab):
            pb = probs(prompt + [a])[b]
            pc = probs(prompt + [a, b])
            for c in range(vocab):
                expected[(a, b, c)] = float(pa * pb * pc[c]) * n_requests
    big = [k for k, e in expected.items() if e >= 5]
    obs = [observed[k] for k in big] + [n_requests - sum(observed[k] for k in big)]
    exp = [expected[k] for k in big] + [n_requests - sum(expected[k] for k in big)]
    assert len(big) >= 15
    assert not set(observed) - {k for k, e in expected.items() if e > 0}  # never a filtered-out token
    assert chisquare(obs, exp).pvalue > 1e-3
    if pearl == "on":  # random drafts are sometimes right: some trees were drafted ahead
        assert core.pearl.stats.post_verify > 0


# ---- the real TargetWorker: KV and drafter state are freed ------------------------------------

@pytest.fixture(scope="module")
def tiny_stages(tiny_checkpoint) -> list[LlamaStage]:
    return build_stages(tiny_checkpoint, tiny_checkpoint.load_state_dict(), 2,
                               dtype=torch.float32, device="cpu")


def tiny_core(tiny_stages, drafters, **config):
    worker = TargetWorker(tiny_stages, external_blocks=True)
    core = EngineCore(engine_config(**config), LocalTargetClient(worker),
                    [LocalDrafterClient(DrafterWorker(d)) for d in drafters], vocab_size=256)
    return worker, core


def tiny_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 9)]


def test_finished_requests_free_target_and_drafter_state(tiny_checkpoint, tiny_stages):
    ngram = NgramDrafter()
    model = ModelDrafter(LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict()), name="self")
    worker, core = tiny_core(tiny_stages, [ngram, model], num_speculative_tokens=4)
    for i, p in enumerate(tiny_prompts()):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=6 + 5 * i))

    async def go():
        seen_cached = 0
        while core.has_work:
            await core.step()
            seen_cached = max(seen_cached, worker.num_cached_requests())
        return seen_cached

    assert asyncio.run(go()) == 3
    assert worker.num_cached_requests() == 0
    assert ngram.num_tracked_requests == 0
    assert model.cache.request_ids == [] and model._seen == {}


def test_abort_frees_target_and_drafter_state(tiny_checkpoint, tiny_stages):
    ngram = NgramDrafter()
    model = ModelDrafter(LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict()), name="self")
    worker, core = tiny_core(tiny_stages, [ngram, model], num_speculative_tokens=3,
                                 max_num_seqs=2)
    prompts = tiny_prompts()
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=40))

    async def go():
        await core.step()
        await core.step()
        assert worker.num_cached_requests() == 2 and ngram.num_tracked_requests == 2
        assert core.abort("r0") and core.abort("r2")  # running and waiting
        assert not core.abort("r2") and not core.abort("nope")
        outs = await core.step()
        assert {o.request_id for o in outs} == {"r1"}
        assert worker.num_cached_requests() == 1 and ngram.num_tracked_requests == 1
        assert model.cache.request_ids == ["r1"]
        core.abort("r1")
        await core.step()
        assert not core.has_work

    asyncio.run(go())
    assert worker.num_cached_requests() == 0 and ngram.num_tracked_requests == 0
    assert model.cache.request_ids == []


def test_closing_a_stream_aborts_and_frees(tiny_checkpoint, tiny_stages):
    ngram = NgramDrafter()
    worker, core = tiny_core(tiny_stages, [ngram], num_speculative_tokens=3)
    loop = EngineLoop(core)

    async def go():
        other = asyncio.create_task(loop.generate_all(tiny_prompts()[1], SamplingParams(max_tokens=30), "keep"))
        stream = loop.generate(tiny_prompts()[0], SamplingParams(max_tokens=200), "gone")
        n = 0
        async for out in stream:
            n += len(out.new_token_ids)
            if n >= 3:
                break
        await stream.aclose()  # the client went away
        kept = await other
        for _ in range(100):  # the loop releases at its next step
            if not core.has_work:
                break
            await asyncio.sleep(0.01)
        await loop.shutdown()
        return kept

    kept = asyncio.run(go())
    assert kept.finish_reason == "length" and len(kept.new_token_ids) == 30
    assert worker.num_cached_requests() == 0 and ngram.num_tracked_requests == 0


def test_abort_by_id_ends_a_stream_nobody_reads_and_refuses_a_late_generate(tiny_checkpoint, tiny_stages):
    """The ingress's explicit abort (sent besides closing its stream, whose cancellation Serve
    may lose): a stream left open and unread is ended and freed; an id aborted before its
    ``generate`` arrives never starts."""
    ngram = NgramDrafter()
    worker, core = tiny_core(tiny_stages, [ngram], num_speculative_tokens=3)
    loop = EngineLoop(core)

    async def drain(stream) -> list:
        return [out async for out in stream]

    async def go():
        stream = loop.generate(tiny_prompts()[0], SamplingParams(max_tokens=200), "orphan")
        first = await stream.__anext__()  # then nobody reads it again, and nobody closes it
        assert loop.abort("orphan")
        rest = await asyncio.wait_for(drain(stream), 10)  # what was queued, then the end
        for _ in range(100):  # the loop releases at its next step
            if not core.has_work:
                break
            await asyncio.sleep(0.01)
        freed = worker.num_cached_requests() == 0 and ngram.num_tracked_requests == 0
        assert not loop.abort("late")  # not seen yet: remembered
        late = await asyncio.wait_for(drain(loop.generate(tiny_prompts()[1], SamplingParams(max_tokens=30), "late")), 10)
        again = await loop.generate_all(tiny_prompts()[1], SamplingParams(max_tokens=5), "late")  # once only
        await loop.shutdown()
        return first, rest, freed, late, again

    first, rest, freed, late, again = asyncio.run(go())
    total = len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest)
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and total < 200
    assert freed and core.metrics.get("cosine_ray:request_success", finished_reason="abort") == 1
    assert [(o.new_token_ids, o.finish_reason) for o in late] == [([], "abort")]
    assert again.finish_reason == "length" and len(again.new_token_ids) == 5


def test_target_failure_fails_running_requests_without_hanging():
    target = TableTarget()
    loop = EngineLoop(make_core(target, [OracleDrafter("oracle", target)], num_speculative_tokens=2))

    async def go():
        target.fail_next = 1
        failed = await asyncio.wait_for(asyncio.gather(
            *(loop.generate_all(p, SamplingParams(max_tokens=8)) for p in PROMPTS)), 10)
        ok = await asyncio.wait_for(loop.generate_all(PROMPTS[0], SamplingParams(max_tokens=8)), 10)
        await loop.shutdown()
        return failed, ok

    failed, ok = asyncio.run(go())
    assert all(f.finish_reason == "error" and "target stage died" in f.error for f in failed)
    assert ok.new_token_ids == target.greedy(PROMPTS[0], 8)


def test_kv_cap_error_reaches_the_caller(tiny_checkpoint, tiny_stages):
    worker = TargetWorker(tiny_stages, max_kv_tokens=30, external_blocks=True)
    core = EngineCore(engine_config(num_speculative_tokens=4), LocalTargetClient(worker), [], vocab_size=256)
    loop = EngineLoop(core)

    async def go():
        out = await asyncio.wait_for(loop.generate_all(list(range(20)), SamplingParams(max_tokens=40)), 10)
        for _ in range(100):
            if not core.has_work:
                break
            await asyncio.sleep(0.01)
        await loop.shutdown()
        return out

    out = asyncio.run(go())
    assert out.finish_reason == "error" and "MemoryError" in out.error
    assert worker.num_cached_requests() == 0


class CheckedModelDrafter(LocalDrafterClient):
    """A ModelDrafter whose every proposal is compared with a fresh greedy run of its model on
    the context (no cache): its per-request KV must follow rejections and rollbacks."""

    def __init__(self, drafter: ModelDrafter) -> None:
        super().__init__(drafter)
        self.num_checked = 0

    async def propose(self, inputs):
        proposals = await super().propose(inputs)
        model = self.worker.drafter.model
        for item, proposal in zip(inputs, proposals):
            context, expected = list(item.context_token_ids), []
            for _ in range(len(proposal.paths[0]) if proposal.paths else 0):
                cache = model.new_kv_cache()
                cache.allocate("check")
                logits = model.forward(StageBatch.from_chains(["check"], [context + expected], [0]), cache)
                expected.append(int(logits[-1].argmax()))
            if proposal.paths:
                assert proposal.paths[0] == expected, item.request_id
                self.num_checked += 1
        return proposals

    async def continue_drafts(self, queries):
        answers = await super().continue_drafts(queries)
        for q, per_prefix in zip(queries, answers):
            for prefix, cands in zip(q.prefixes, per_prefix):
                self._check(q, list(prefix), cands)
        return answers

    async def continue_chains(self, queries):
        """Each position of each chain, against a fresh run on ``context ⊕ prefix ⊕ tops so far``."""
        answers = await super().continue_chains(queries)
        for q, per_prefix in zip(queries, answers):
            for prefix, chain in zip(q.prefixes, per_prefix):
                assert 1 <= len(chain) <= q.depth
                prefix = list(prefix)
                for cands in chain:
                    self._check(q, prefix, cands)
                    prefix.append(cands[0][0])
        return answers

    def _check(self, q, prefix, cands):
        model = self.worker.drafter.model
        cache = model.new_kv_cache()
        cache.allocate("check")
        logits = model.forward(StageBatch.from_chains(["check"], [list(q.context_token_ids) + prefix], [0]), cache)
        assert cands and cands[0][0] == int(logits[-1].argmax()), q.request_id
        self.num_checked += 1


@pytest.mark.parametrize("config", [dict(CLASSIC, min_tree_confidence=0.0), dict(adaptive=False)],
                         ids=["propose", "fusion"])
def test_model_drafter_stays_in_sync_with_the_context(tiny_checkpoint, tiny_draft_checkpoint, tiny_stages, config):
    drafter = ModelDrafter(LlamaStage(tiny_draft_checkpoint.config, tiny_draft_checkpoint.load_state_dict()),
                           name="draft")
    checked = CheckedModelDrafter(DrafterWorker(drafter))
    worker = TargetWorker(tiny_stages, external_blocks=True)
    core = EngineCore(engine_config(num_speculative_tokens=3, **config), LocalTargetClient(worker), [checked],
                    vocab_size=256)
    for i, p in enumerate(tiny_prompts()):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=20))
    tokens, finals = asyncio.run(drain(core))
    assert checked.num_checked >= 3 * 5
    assert any(f.stats.num_accepted_tokens < f.stats.num_draft_tokens for f in finals.values())  # rejections
    assert drafter.cache.request_ids == [] and worker.num_cached_requests() == 0


# ---- regressions -----------------------------------------------------------------------------

def test_abort_while_step_awaits_drafters():
    """abort() from another task while step() awaits the drafters: the step must not fail
    (it used to raise KeyError on ``del self.running[...]``, failing every running request)."""
    target = TableTarget()
    slow = HangingDrafter("slow", seconds=0.05)
    core = make_core(target, [slow], num_speculative_tokens=2, drafter_deadline_s=1.0)
    core.add_request("a", PROMPTS[0], SamplingParams(max_tokens=10))
    core.add_request("b", PROMPTS[1], SamplingParams(max_tokens=10))

    async def go():
        outputs = await core.step()  # prefill
        step = asyncio.create_task(core.step())
        await slow.called.wait()  # the step is waiting for the drafter
        assert not step.done() and core.abort("a")
        outputs += await step
        while core.has_work:
            outputs += await core.step()
        return outputs

    outputs = asyncio.run(go())
    tokens = defaultdict(list)
    for out in outputs:
        tokens[out.request_id] += out.new_token_ids
    finals = {out.request_id: out for out in outputs if out.finished}
    assert finals["b"].finish_reason == "length"
    assert "a" not in finals or finals["a"].finish_reason == "abort"
    assert tokens["b"] == target.greedy(PROMPTS[1], 10)
    assert target.committed == {}


def test_duplicate_request_id_does_not_hang_the_first_stream():
    """A second stream with an id in use is refused without touching the first one (its queue
    used to be replaced, then deleted, so the first stream hung forever)."""
    target = TableTarget()
    loop = EngineLoop(make_core(target, [], num_speculative_tokens=0))

    async def go():
        first = asyncio.create_task(loop.generate_all(PROMPTS[0], SamplingParams(max_tokens=30), "x"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in use"):
            await loop.generate_all(PROMPTS[1], SamplingParams(max_tokens=5), "x")
        try:
            return await asyncio.wait_for(first, 5)
        finally:
            await loop.shutdown()

    out = asyncio.run(go())
    assert out.new_token_ids == target.greedy(PROMPTS[0], 30)


def test_abort_in_one_lane_while_another_lane_steps(tiny_stages):
    worker = TargetWorker(tiny_stages, external_blocks=True)
    slow = HangingDrafter("slow", seconds=0.05)
    core = EngineCore(engine_config(num_speculative_tokens=2, num_lanes=2, drafter_deadline_s=1.0),
                    LocalTargetClient(worker), [slow], vocab_size=256)
    prompts = tiny_prompts()
    core.add_request("a", prompts[0], SamplingParams(max_tokens=10))
    core.add_request("b", prompts[1], SamplingParams(max_tokens=10))

    async def go():
        await core.step(0)
        await core.step(1)  # both prefilled, one per lane
        assert {rid: r.lane for rid, r in core.running.items()} == {"a": 0, "b": 1}
        slow.called.clear()
        lane0 = asyncio.create_task(core.step(0))
        await slow.called.wait()  # lane 0 waits for the drafter
        assert not lane0.done() and core.abort("a")
        # Lane 1 must not free "a" while lane 0 still works on it: lane 0's later drafter or
        # stage calls would recreate the state the release freed (a leak seen on a real
        # server with two lanes, where a call is sent only when its task first runs).
        await core.step(1)
        assert "a" not in slow.released and "a" in core.pool.to_release
        await lane0  # must not score the aborted request
        assert "a" not in slow.released
        await core.step(1)  # no step holds "a" now: this one frees it
        assert slow.released.count("a") == 1
        while core.has_work:
            await core.step()

    asyncio.run(go())
    assert worker.num_cached_requests() == 0
