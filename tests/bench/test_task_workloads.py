"""The ``edit`` and ``agent`` workloads of ``cosine-ray bench`` (``loadgen.tasks``): packaged
data with held-back halves, scripted requests that repeat what came before, predictions sent as
the system asks, and what the bench reports of them (accepted and rejected prediction tokens,
the turns after the first)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from cosine_ray.bench.conversations import Turn, later_turns, prediction_counts, prediction_text, run_conversations
from cosine_ray.bench.workloads import bench_workload
from cosine_ray.cli.args import CliError
from cosine_ray.datasets import PACKAGED_PROMPT_DIR, read_prompts, second_half
from loadgen.tasks import AGENT_FILE, TASKS_DIR, ScriptedTurn, agent_turns, useless_prediction

EDITS = PACKAGED_PROMPT_DIR / TASKS_DIR / "edit.jsonl"


def test_the_edit_tasks_are_whole_functions_with_an_instruction_and_the_original_as_prediction():
    rows = read_prompts(EDITS)
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30
    humaneval = {r["id"]: r["prompt"] for r in read_prompts(PACKAGED_PROMPT_DIR / "humaneval.jsonl")}
    for r in rows:
        compile(r["code"], r["id"], "exec")  # a whole function, not a stub
        stub = humaneval[r["source"]].split("\n", 1)[1].strip("\n")
        assert r["code"].startswith(stub) and len(r["code"]) > len(stub) + 10
        assert r["code"] in r["prompt"] and r["edit"] in r["prompt"]
        assert r["prediction"] == f"```python\n{r['code']}```"


@pytest.mark.parametrize("name", ["edit", "agent"])
def test_measured_conversations_come_from_the_held_back_half(name):
    warm, measured = bench_workload(name, PACKAGED_PROMPT_DIR, 5, 3, 64, 0)
    assert len(warm) == 3 and len(measured) == 5
    source = EDITS if name == "edit" else PACKAGED_PROMPT_DIR / "humaneval.jsonl"
    held = {r.get("source", r["id"]) for r in second_half(read_prompts(source))}
    assert all(i.source_id.split("#")[0] in held for i in measured)
    assert not any(i.source_id.split("#")[0] in held for i in warm)
    assert len({i.source_id for i in measured}) == 5  # every row once before any twice
    again, _ = bench_workload(name, PACKAGED_PROMPT_DIR, 5, 3, 64, 0)
    assert again == warm  # seeded


def test_every_agent_request_repeats_the_calls_and_observations_before_it():
    stub = read_prompts(PACKAGED_PROMPT_DIR / "humaneval.jsonl")[100]["prompt"]
    turns = agent_turns(stub)
    assert len(turns) == 4
    for before, after in zip(turns, turns[1:]):
        assert after.messages[:len(before.messages)] == before.messages  # the loop's history grows
        assert [role for role, _ in after.messages[len(before.messages):]] == ["assistant", "tool"]
    calls = [json.loads(content) for role, content in turns[-1].messages if role == "assistant"]
    assert [c["tool"] for c in calls] == ["read_file", "write_file", "run_tests"]
    assert all(c["arguments"]["path"] == AGENT_FILE for c in calls)
    code = stub.split("\n", 1)[1].strip("\n") + "\n"
    observation = json.loads(turns[1].messages[-1][1])
    assert observation["content"] == code and calls[1]["arguments"]["content"].startswith(code)
    assert all(t.prediction == "" for t in turns)


def test_predictions_are_the_workloads_none_or_random_words_as_long():
    turn = ScriptedTurn((("user", "change it"),), "def f():\n    return 1\n")
    assert prediction_text(turn, "workload", 0) == turn.prediction
    assert prediction_text(turn, "none", 0) == ""
    noise = prediction_text(turn, "random", 3)
    assert len(noise) == len(turn.prediction) and noise != turn.prediction
    assert noise == useless_prediction(turn.prediction, 3) and noise != useless_prediction(turn.prediction, 4)
    assert prediction_text(ScriptedTurn((("user", "x"),)), "random", 0) == ""
    with pytest.raises(ValueError, match="prediction must be"):
        prediction_text(turn, "maybe", 0)


class CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return [ord(c) for c in "|".join(f"{m['role']}:{m['content']}" for m in messages) + ">"]


class EchoEngine:
    """Answers every request with its prediction (or "ok"), and keeps what it was sent."""

    def __init__(self) -> None:
        self.sent = []
        self.loop = self

    async def generate_all(self, ids, params):
        self.sent.append((list(ids), params.prediction))
        return SimpleNamespace(new_token_ids=list(params.prediction) or [ord("o"), ord("k")], finish_reason="stop",
                               stats=None)

    async def shutdown(self) -> None:
        pass


def test_scripted_turns_are_sent_as_written_with_their_prediction():
    from cosine_ray.engine.request import SamplingParams
    engine, tok = EchoEngine(), CharTokenizer()
    conv = (ScriptedTurn((("user", "a"),), "xyz"), ScriptedTurn((("user", "a"), ("assistant", "q"), ("tool", "r"))))
    outs = asyncio.run(run_conversations(engine, [conv], SamplingParams(max_tokens=4), 1, tok))
    (first, second), = outs
    assert engine.sent[0] == ([ord(c) for c in "user:a>"], tuple(ord(c) for c in "xyz"))
    assert engine.sent[1] == ([ord(c) for c in "user:a|assistant:q|tool:r>"], ())  # the script, not the answer
    assert first.prediction_ids == tuple(ord(c) for c in "xyz") and second.prediction_ids == ()
    assert prediction_counts(outs) == (3, 0)
    assert first.seconds >= 0 and later_turns(outs) == (2, second.seconds)


def test_prediction_counts_and_later_turns_sum_over_conversations():
    outs = [[Turn([1, 2, 3], seconds=1.0, prediction_ids=(1, 9, 3)), Turn([4, 5], seconds=0.5)],
            [Turn([7], seconds=2.0), Turn([8, 8, 8], seconds=1.5, prediction_ids=(8,))]]
    assert prediction_counts(outs) == (2 + 1, 1 + 0)
    assert later_turns(outs) == (5, 2.0)


def test_a_system_may_change_what_its_requests_predict():
    from cosine_ray.cli.bench import parse_systems
    none, plain, noisy = parse_systems("none;default;default@prediction=random,num_speculative_tokens=4")
    assert (none.prediction, plain.prediction, noisy.prediction) == ("workload", "workload", "random")
    assert noisy.settings == {"num_speculative_tokens": 4}
    with pytest.raises(CliError, match="prediction must be"):
        parse_systems("default@prediction=sometimes")
