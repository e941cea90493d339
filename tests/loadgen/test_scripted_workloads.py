"""``cosine-loadgen --workload json|edit|rag|agent|mixed``: scripted requests (``loadgen.tasks``)
are sent as written, whatever the server answered before, with their prediction and response
format; the plan keeps the held-back half and refuses the completions endpoint."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from support.stub_server import StubServer

from loadgen.cli import UsageError, build_parser, build_plan
from loadgen.runner import RunConfig, run_plan
from loadgen.prompt_sets import packaged_prompt_dir
from loadgen.tasks import MIXED_KINDS, ScriptedTurn, task_workload


def test_scripted_turns_are_sent_as_written_with_their_prediction():
    item = task_workload("agent", packaged_prompt_dir(), "second-half", 1, 3, 0)[0]
    edit = dataclasses.replace(task_workload("edit", packaged_prompt_dir(), "second-half", 1, 3, 0)[0],
                               conversation_id="c00001")  # each plan numbers its conversations from 0
    with StubServer(ttft_s=0.001, chunk_s=0.001, num_chunks=3) as stub:
        result = run_plan([(item, 0.0), (edit, 0.0)], RunConfig(base_url=stub.url, show_progress=False))
        received = dict(stub.received)
    assert [r.status for r in result.records] == ["ok"] * 5
    for turn, script in enumerate(item.turns):
        body = received[f"{item.conversation_id}-t{turn}"]
        assert body["messages"] == script.chat  # the script, not the stub's answers
        assert "prediction" not in body
    (turn,) = edit.turns
    body = received[f"{edit.conversation_id}-t0"]
    assert body["messages"] == turn.chat and body["prediction"] == {"type": "content", "content": turn.prediction}
    assert isinstance(turn, ScriptedTurn) and turn.prediction.startswith("```python\n")


def test_the_plan_uses_the_split_and_the_chat_endpoint():
    args = build_parser().parse_args(["run", "--workload", "edit", "--num-prompts", "20"])
    plan, described = build_plan(args)
    assert described["num_requests"] == 20 and described["split"] == "second-half"
    assert len({item.source_id for item, _ in plan[:15]}) == 15  # the 15 held-back edits, then again
    with pytest.raises(UsageError, match="chat endpoint"):
        build_plan(build_parser().parse_args(["run", "--workload", "agent", "--endpoint", "completions"]))


def test_a_json_request_carries_its_schema_as_response_format():
    item = task_workload("json", packaged_prompt_dir(), "second-half", 1, 3, 0)[0]
    with StubServer(ttft_s=0.001, chunk_s=0.001, num_chunks=3) as stub:
        result = run_plan([(item, 0.0)], RunConfig(base_url=stub.url, show_progress=False))
        body = dict(stub.received)[f"{item.conversation_id}-t0"]
    assert [r.status for r in result.records] == ["ok"]
    (turn,) = item.turns
    assert body["messages"] == turn.chat and "prediction" not in body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "record", "schema": json.loads(turn.schema), "strict": True}}


def test_the_mixed_plan_splits_its_requests_over_every_kind():
    plan, described = build_plan(build_parser().parse_args(["run", "--workload", "mixed", "--num-prompts", "12"]))
    kinds = Counter(item.domain if item.domain in MIXED_KINDS else "chat" for item, _ in plan)
    assert sum(kinds.values()) == 12 and set(kinds) == set(MIXED_KINDS) and max(kinds.values()) == 3
    assert described["workload"] == "mixed" and described["split"] == "second-half"
    with pytest.raises(UsageError, match="chat endpoint"):
        build_plan(build_parser().parse_args(["run", "--workload", "mixed", "--endpoint", "completions"]))


def test_chat_is_the_dataset_workload_under_its_new_name():
    chat, _ = build_plan(build_parser().parse_args(["run", "--num-prompts", "8"]))
    dataset, _ = build_plan(build_parser().parse_args(["run", "--workload", "dataset", "--num-prompts", "8"]))
    assert [i for i, _ in chat] == [i for i, _ in dataset]
    assert {i.domain for i, _ in chat} == {"code", "math", "instruction", "chat"}
