"""The ``json``, ``rag`` and ``mixed`` workloads of ``cosine-ray bench`` (``loadgen.tasks``):
packaged data with held-back halves, schemas sent as the request's grammar, answers that copy
from the passages, every kind interleaved; HF, which applies no grammar, is kept out of a
workload with a schema, whose outputs are compared with plain decoding instead."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from types import SimpleNamespace

import jsonschema
import pytest
from support.byte_tokenizer import SIMPLE_CHAT_TEMPLATE, byte_tokenizer

from cosine_ray.bench.conversations import has_grammar, run_conversations, run_hf
from cosine_ray.bench.workloads import BENCH_WORKLOADS, bench_workload
from cosine_ray.cli.args import CliError
from cosine_ray.datasets import PACKAGED_PROMPT_DIR, read_prompts, second_half
from cosine_ray.engine.request import SamplingParams, StructuredOutput
from loadgen.tasks import MIXED_KINDS, RAG_PASSAGES, TASKS_DIR, ScriptedTurn, rag_turn

JSON_TASKS = PACKAGED_PROMPT_DIR / TASKS_DIR / "json.jsonl"
GSM8K = PACKAGED_PROMPT_DIR / "gsm8k.jsonl"


def test_the_json_tasks_hold_a_valid_schema_and_a_text_to_extract_from():
    rows = read_prompts(JSON_TASKS)
    assert len(rows) == 32 and len({r["id"] for r in rows}) == 32
    kinds = Counter(r["schema_name"] for r in rows)
    assert len(kinds) == 4 and set(kinds.values()) == {8}
    held = second_half(rows)
    assert Counter(r["schema_name"] for r in held) == Counter({k: 4 for k in kinds})  # both halves hold every schema
    for r in rows:
        schema = json.loads(r["schema"])
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert r["text"] in r["prompt"] and r["schema"] in r["prompt"]  # the keys are in the context


@pytest.mark.real_model
def test_every_packaged_schema_compiles_to_a_grammar(real_checkpoint):
    from cosine_ray.engine.owners.grammars import GrammarCompiler
    tokenizer = real_checkpoint.load_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    schemas = {r["schema"] for r in read_prompts(JSON_TASKS)}
    for schema in schemas:
        compiler.check(StructuredOutput("json_schema", schema))  # RequestRefused when it does not compile
    assert compiler.num_compiles == len(schemas) == 4


@pytest.mark.parametrize("name", ["json", "rag", "mixed"])
def test_measured_conversations_come_from_the_held_back_half(name):
    warm, measured = bench_workload(name, PACKAGED_PROMPT_DIR, 4, 2, 64, 0)
    per = len(MIXED_KINDS) if name == "mixed" else 1
    assert len(measured) == 4 * per and len(warm) == 2 * per
    held = {r["id"] for path in (JSON_TASKS, GSM8K, PACKAGED_PROMPT_DIR / "humaneval.jsonl")
            for r in second_half(read_prompts(path))}
    held |= {r["source"] for r in second_half(read_prompts(PACKAGED_PROMPT_DIR / TASKS_DIR / "edit.jsonl"))}
    held |= {r["id"] for f in ("alpaca", "mtbench") for r in second_half(read_prompts(PACKAGED_PROMPT_DIR / f"{f}.jsonl"))}
    assert all(i.source_id.split("#")[0] in held for i in measured)
    assert not any(i.source_id.split("#")[0] in held for i in warm)
    assert [i.conversation_id for i in measured] == [f"c{i:05d}" for i in range(len(measured))]
    again, _ = bench_workload(name, PACKAGED_PROMPT_DIR, 4, 2, 64, 0)
    assert again == warm  # seeded


def test_json_requests_carry_their_schema_and_no_prediction():
    _, measured = bench_workload("json", PACKAGED_PROMPT_DIR, 3, 0, 64, 0)
    for item in measured:
        (turn,) = item.turns
        assert turn.schema and turn.prediction == "" and item.domain == "json"
        fields = turn.body_fields()
        assert fields == {"response_format": {"type": "json_schema", "json_schema": {
            "name": "record", "schema": json.loads(turn.schema), "strict": True}}}
    assert has_grammar([i.turns for i in measured])
    _, edits = bench_workload("edit", PACKAGED_PROMPT_DIR, 2, 0, 64, 0)
    assert not has_grammar([i.turns for i in edits])
    assert set(edits[0].turns[0].body_fields()) == {"prediction"}


def test_a_rag_request_numbers_its_passages_and_asks_to_copy_from_one():
    passages = ["Ann has 3 apples. How many?", "Bo runs 5 miles. How far?", "Cy reads 2 books. How many?"]
    tasks = [str(rag_turn(passages, n)) for n in range(9)]
    for n, text in enumerate(tasks):
        assert all(f"[{i}] {p}" in text for i, p in enumerate(passages, 1))
        assert f"passage [{1 + n % RAG_PASSAGES}]" in text.split("\n\n")[-1]
    assert len({t.split("\n\n")[-1].replace(str(1 + n % 3), "k") for n, t in enumerate(tasks)}) == 3  # 3 task kinds
    _, measured = bench_workload("rag", PACKAGED_PROMPT_DIR, 2, 0, 64, 0)
    held = [r["prompt"] for r in second_half(read_prompts(GSM8K))]
    for item in measured:
        text = str(item.turns[0])
        assert sum(p in text for p in held) == RAG_PASSAGES


def test_mixed_interleaves_every_kind_in_equal_numbers():
    _, measured = bench_workload("mixed", PACKAGED_PROMPT_DIR, 3, 0, 64, 0)
    kinds = Counter(i.domain if i.domain in MIXED_KINDS[:-1] else "chat" for i in measured)
    assert kinds == Counter(dict.fromkeys(MIXED_KINDS, 3))
    order = [i.domain for i in measured]
    assert order != sorted(order, key=lambda d: [*MIXED_KINDS, d].index(d))  # interleaved, not kind after kind
    assert all(isinstance(i.turns[0], str) for i in measured if i.domain not in MIXED_KINDS[:-1])  # chat: user turns


def test_the_bench_names_every_workload_and_refuses_others():
    for name in BENCH_WORKLOADS:
        warm, measured = bench_workload(name, PACKAGED_PROMPT_DIR, 1, 0, 8, 0)
        assert measured and not warm
    from loadgen.workload import WorkloadError
    with pytest.raises(WorkloadError, match="--workload must be one of chat, json, edit, rag, agent, mixed"):
        bench_workload("dataset", PACKAGED_PROMPT_DIR, 1, 0, 8, 0)


def chat_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return tokenizer


class RecordingEngine:
    def __init__(self) -> None:
        self.sent = []
        self.loop = self

    async def generate_all(self, ids, params):
        self.sent.append(params)
        return SimpleNamespace(new_token_ids=[ord("{"), ord("}")], finish_reason="stop", stats=None)

    async def shutdown(self) -> None:
        pass


def test_a_turn_with_a_schema_is_decoded_under_it_and_never_by_hf():
    schema = json.dumps({"type": "object"})
    conv = (ScriptedTurn((("user", "a"),), schema=schema), ScriptedTurn((("user", "b"),), "xy"))
    engine = RecordingEngine()
    asyncio.run(run_conversations(engine, [conv], SamplingParams(max_tokens=4), 1, chat_tokenizer()))
    assert engine.sent[0].structured == StructuredOutput("json_schema", schema) and engine.sent[0].prediction == ()
    assert engine.sent[1].structured is None and engine.sent[1].prediction == (ord("x"), ord("y"))
    with pytest.raises(ValueError, match="without a grammar"):
        run_hf(None, chat_tokenizer(), [conv], 4)


def test_the_bench_keeps_hf_out_of_a_workload_with_a_schema(monkeypatch):
    from cosine_ray import cli
    from cosine_ray.cli import bench
    monkeypatch.setattr("cosine_ray.models.loader.resolve_checkpoint",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("refused before the model")))
    args = cli.build_parser().parse_args(["bench", "--workload", "json", "--systems", "hf-greedy;none",
                                          "--prompts-per-domain", "1"])
    with pytest.raises(CliError, match="leave hf-greedy, hf-prompt-lookup out of --systems"):
        bench.run(args)
    assert bench.parse_systems(bench.DEFAULT_SYSTEMS)[0].is_hf  # the default drops them on such a workload


@pytest.mark.real_model
@pytest.mark.parametrize("workload, systems", [("json", "none;default"), ("mixed", "default;none")])
def test_the_bench_runs_a_traffic_workload_end_to_end(workload, systems, tmp_path, capsys):
    """Tiny sizes on the embedded model: every output equals plain decoding's (none, also when it
    is not listed first), and the edits report their prediction tokens."""
    from cosine_ray import cli
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--workload", workload, "--systems", systems, "--prompts-per-domain", "1",
                     "--max-tokens", "12", "--threads", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["lossless_reference"] == "none c=1"
    assert {r["system"] for r in report["results"]} == set(systems.split(";"))
    for row in report["results"]:
        same, total = row["lossless_identical"].split("/")
        assert same == total == str(report["measured_conversations"] + (3 if workload == "mixed" else 0))
    if workload == "mixed":
        assert {c["domain"] for c in report["conversations"]} >= {"json", "edit", "rag", "agent"}
        assert all("prediction" in r for r in report["results"])
