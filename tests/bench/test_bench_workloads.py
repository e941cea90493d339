"""``cosine_ray.bench.workloads`` and ``conversations``: what the benchmarks send, from the packaged
prompt sets, and conversations through an engine, with a fake tokenizer and engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cosine_ray.bench.conversations import Turn, count_tokens, run_conversations, same_output
from cosine_ray.bench.workloads import fixed_length_prompts, held_back_split
from cosine_ray.datasets import DOMAIN_FILES, PACKAGED_PROMPT_DIR, domain_prompts


def test_held_back_split_measures_first_and_warms_up_on_the_next_held_back_prompts():
    warm, measured = held_back_split(PACKAGED_PROMPT_DIR, 2, 3)
    assert [d for d, _ in measured] == [d for d in DOMAIN_FILES for _ in range(3)]
    assert [d for d, _ in warm] == [d for d in DOMAIN_FILES for _ in range(2)]
    for domain in DOMAIN_FILES:
        held = [r["prompt"] for r in domain_prompts(domain, "second-half", PACKAGED_PROMPT_DIR)]
        assert [p for d, p in measured if d == domain] == held[:3]
        assert [p for d, p in warm if d == domain] == held[3:5]
    _, same = held_back_split(PACKAGED_PROMPT_DIR, 9, 3)
    assert same == measured  # a bigger warm-up never changes what is measured


class CharTokenizer:
    """One token a character; a chat is its messages' contents joined by ``|``."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return [ord(c) for c in "|".join(m["content"] for m in messages) + ">"]


def test_fixed_length_prompts_have_exactly_the_length_asked():
    prompts = fixed_length_prompts(CharTokenizer(), 5, 300)
    assert len(prompts) == 5 and all(len(p) == 300 for p in prompts)
    first = domain_prompts(next(iter(DOMAIN_FILES)), "all")[0]["prompt"]
    assert "".join(chr(t) for t in prompts[0]).startswith(first[:300])  # the packaged texts, in order


class FakeEngine:
    """Answers every prompt with its last three tokens reversed; counts the requests in flight."""

    def __init__(self) -> None:
        self.prompts, self.in_flight, self.most, self.shut = [], 0, 0, False
        self.loop = self

    async def generate_all(self, ids, params):
        self.prompts.append(list(ids))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        return SimpleNamespace(new_token_ids=list(ids[-3:])[::-1], finish_reason="stop", stats="s")

    async def shutdown(self) -> None:
        self.shut = True


def test_each_turn_is_sent_with_the_history_and_its_answer_kept():
    engine, tok = FakeEngine(), CharTokenizer()
    outs = asyncio.run(run_conversations(engine, [("ab", "cd"), ("x",), ("y",)], None, 2, tok))
    (first, second), (x,), (y,) = outs
    assert first.prompt_ids == tuple(ord(c) for c in "ab>") and first.token_ids == [ord(c) for c in ">ba"]
    assert second.prompt_ids == tuple(ord(c) for c in "ab|>ba|cd>")  # turn 1 and its answer before turn 2
    assert (x.finish_reason, x.stats) == ("stop", "s") and x.token_ids == [ord(c) for c in ">x"]
    assert engine.most == 2 and engine.shut and count_tokens(outs) == 3 + 3 + 2 + 2


def test_same_output_allows_an_earlier_stop_only_at_end_of_text():
    ref = Turn([1, 2, 3, 4])
    assert same_output(Turn([1, 2, 3, 4], "length"), ref)
    assert same_output(Turn([1, 2], "stop"), ref) and not same_output(Turn([1, 2], "length"), ref)
    assert not same_output(Turn([1, 2, 9, 4], "length"), ref)
