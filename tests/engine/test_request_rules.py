"""Score rules and log-probabilities under speculation, on the tiny random model (fp32).

Every rule is applied at each draft-tree node from that node's own path, so the text with the
default drafters (and with the target drafting for itself: deep trees, mostly accepted) equals
the text with none; log-probabilities equal HF transformers' ``log_softmax``; the penalties and
bias equal an independent reference over HF's logits (``support/penalties.py``; HF's own
``repetition_penalty`` for that one), and ``min_tokens`` a reference loop over HF's logits."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.algo.logits_rules import RowRules, apply_rules, token_logprobs, unpack_bitmask
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from support.penalties import penalized_greedy

MAX_TOKENS = 24
DRAFTER_SETS = ("none", "ngram,suffix", "ngram,self")


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return tiny_checkpoint.load_hf_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 19, 40)]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    cache: dict[str, LocalEngine] = {}

    def get(drafters: str) -> LocalEngine:
        if drafters not in cache:  # verify every draft the drafters make (deep trees)
            config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(drafters))
            cache[drafters] = LocalEngine(config.replace(min_tree_confidence=0.0, adaptive=False),
                                          checkpoint=tiny_checkpoint)
        return cache[drafters]

    return get


def run(engines, prompts, params):
    return {d: engines(d).generate(prompts, params) for d in DRAFTER_SETS}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def reference(hf, prompt, rules: RowRules, n: int) -> list[int]:
    """Plain greedy decoding over HF's logits with ``apply_rules`` on one row at a time."""
    out: list[int] = []
    for _ in range(n):
        row = hf_logits(hf, prompt + out)[-1:]
        out.append(int(apply_rules(row, rules, prompt_ids=prompt, output_ids=out, paths=[()]).argmax()))
    return out


def test_logprobs_equal_hf_log_softmax_with_and_without_drafters(engines, prompts, hf):
    outs = run(engines, prompts, SamplingParams(max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2))
    for i, prompt in enumerate(prompts):
        base = outs["none"][i]
        lp = torch.log_softmax(hf_logits(hf, prompt + base.new_token_ids), -1)
        want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(base.new_token_ids)]
        want_prompt = [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
        for drafters, o in ((d, outs[d][i]) for d in DRAFTER_SETS):
            assert o.new_token_ids == base.new_token_ids, drafters
            assert [x.token_id for x in o.logprobs] == o.new_token_ids
            assert max(abs(x.logprob - w) for x, w in zip(o.logprobs, want)) < 1e-4, drafters
            top = lp[len(prompt) - 1].topk(3)
            assert [t for t, _ in o.logprobs[0].top] == top.indices.tolist()
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
            assert [x.token_id for x in o.prompt_logprobs[1:]] == prompt[1:]
            assert max(abs(x.logprob - w) for x, w in zip(o.prompt_logprobs[1:], want_prompt)) < 1e-4
    assert any(o.stats.mean_accepted_length > 1.5 for o in outs["ngram,self"])  # trees were accepted


def test_repetition_penalty_equals_hf_generate(engines, prompts, hf):
    outs = run(engines, prompts, SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.8))
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
        assert [outs[d][i].new_token_ids for d in DRAFTER_SETS] == [want] * len(DRAFTER_SETS)


@pytest.mark.parametrize("rules", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                   {"presence_penalty": 0.8, "frequency_penalty": 0.6, "logit_bias": ((7, 4.0), (9, -100.0))}],
                         ids=["presence", "frequency", "both-and-bias"])
def test_penalties_and_bias_equal_an_independent_reference(engines, prompts, hf, rules):
    """Each penalty on its own, and both with a bias, against ``support.penalties`` (HF's logits,
    the penalties counted by hand): a penalty the engine ignored, or applied as the reference
    does not, fails here, since each one changes the text of the prompts that repeat a token."""
    outs = run(engines, prompts, SamplingParams(max_tokens=MAX_TOKENS, **rules))
    changed = 0
    for i, prompt in enumerate(prompts):
        want = penalized_greedy(hf, prompt, MAX_TOKENS, presence=rules.get("presence_penalty", 0.0),
                                frequency=rules.get("frequency_penalty", 0.0),
                                logit_bias=dict(rules.get("logit_bias", ())))
        assert [outs[d][i].new_token_ids for d in DRAFTER_SETS] == [want] * len(DRAFTER_SETS)
        changed += want != engines("none").generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0].new_token_ids
    assert changed >= 2, "premise: the rules change the text of most prompts"


def test_min_tokens_and_ignore_eos(tmp_path, prompts, hf, tiny_checkpoint):
    """An EOS the model emits early: min_tokens holds it back, ignore_eos never stops at it."""
    from support.tiny_checkpoint import write_tiny_checkpoint

    plain = engines_for(tiny_checkpoint, "none").generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS))[0]
    eos = plain.new_token_ids[3]  # the 4th greedy token becomes EOS
    ck = write_tiny_checkpoint(tmp_path / "eos", vocab_size=256, seed=0, eos_token_id=eos, init_std=0.2)
    for drafters in ("none", "ngram,self"):
        engine = engines_for(ck, drafters)
        stopped = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS))[0]
        assert stopped.new_token_ids[-1] == eos and len(stopped.new_token_ids) <= 4
        held = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, min_tokens=10))[0]
        rules = RowRules(min_tokens=10, end_ids=(eos,))
        want = reference(hf, prompts[0], rules, MAX_TOKENS)
        cut = next((j + 1 for j, t in enumerate(want) if t == eos and j >= 10), MAX_TOKENS)
        assert held.new_token_ids == want[:cut] and len(held.new_token_ids) > 10
        free = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        assert len(free.new_token_ids) == MAX_TOKENS and eos in free.new_token_ids
        assert free.finish_reason == "length"


def engines_for(ck, drafters):
    config = EngineConfig(model=str(ck.path), drafters=parse_drafters(drafters))
    return LocalEngine(config.replace(min_tree_confidence=0.0, adaptive=False), checkpoint=ck)


def test_seeded_sampling_with_rules_is_reproducible_and_drafter_independent(engines, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=21, frequency_penalty=0.7, logprobs=0)
    outs = run(engines, prompts, params)
    again = engines("ngram,self").generate(prompts, params)
    for i in range(len(prompts)):
        texts = [outs[d][i].new_token_ids for d in DRAFTER_SETS] + [again[i].new_token_ids]
        assert all(t == texts[0] for t in texts)


# ---- the rules alone -------------------------------------------------------------------------

def test_apply_rules_uses_each_rows_own_path():
    logits = torch.zeros(3, 6)
    logits[:, 2] = 1.0
    rules = RowRules(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=2.0, min_tokens=2,
                     end_ids=(5,), logit_bias=((4, 0.25),))
    out = apply_rules(logits, rules, prompt_ids=[3], output_ids=[2], paths=[(), (2,), (1, 1)])
    # row 0: output [2]: token 2 seen once → (1 / 2) - 1 - 0.5; token 3 from the prompt: 0 * 2 = 0
    assert out[0, 2].item() == pytest.approx(0.5 - 1.5) and out[0, 3].item() == 0.0
    assert out[1, 2].item() == pytest.approx(0.5 - 2.0 - 0.5)  # seen twice on its path
    assert out[2, 1].item() == pytest.approx(-2.0 - 0.5)
    assert out[0, 5].item() == -float("inf") and out[1, 5].item() == 0.0  # min_tokens: 1 vs 2 generated
    assert out[:, 4].tolist() == [0.25, 0.25, 0.25]
    assert RowRules().is_identity and not rules.is_identity


def test_bitmask_and_logprobs_helpers():
    bitmask = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)  # bits of tokens 0..63
    allowed = unpack_bitmask(bitmask, 34)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1][:33].all() and not allowed[1][33]
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = token_logprobs(logits, [0], 2)[0]
    want = torch.log_softmax(logits, -1)[0]
    assert lp.logprob == pytest.approx(want[0].item()) and [t for t, _ in lp.top] == [2, 1]


def test_identical_prompts_in_flight_compute_the_prompt_once(engines):
    """Four choices of one 100-token prompt: the first prefills it, the others wait for its
    blocks and take them from the prefix cache (96 of 100 tokens each), and each draws its own
    seeded text, the one it draws alone."""
    import asyncio

    engine = engines("ngram,suffix")
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    before = engine.core.kv.stats.queries - engine.core.kv.stats.hits
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in range(4)]

    async def together():
        try:
            return await asyncio.gather(*(engine.loop.generate_all(prompt, p) for p in params))
        finally:
            await engine.loop.shutdown()

    outs = asyncio.run(together())
    computed = engine.core.kv.stats.queries - engine.core.kv.stats.hits - before
    assert computed == 100 + 3 * 4 and [o.stats.num_cached_tokens for o in outs] == [0, 96, 96, 96]
    alone = [engines("none").generate([prompt], p)[0].new_token_ids for p in params]
    assert [o.new_token_ids for o in outs] == alone
