"""Grammar-constrained decoding under speculation (tiny random model with SmolLM2's tokenizer).

The draft tree is pruned to what the grammar allows and every node's row is masked by the
grammar's state after its own path, so the text equals constrained plain decoding: the same
with the default drafters, with the target drafting for itself, and with none; and equal to an
independent loop that masks HF's logits with llguidance token by token."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from support.tiny_checkpoint import write_tiny_checkpoint

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.owners.constraints import GrammarCompiler
from cosine_ray.engine.request import SamplingParams, StructuredOutput

pytestmark = pytest.mark.real_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "size": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99, "minimum": 0}},
             "required": ["n"], "additionalProperties": False}},
    "required": ["name", "kind", "tags", "size"], "additionalProperties": False}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def ck(tmp_path_factory, real_checkpoint):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("grammar") / "tiny", tokenizer_from=real_checkpoint, seed=3)


@pytest.fixture(scope="module")
def engines(ck):
    cache = {}

    def get(drafters: str) -> LocalEngine:
        if drafters not in cache:
            config = EngineConfig(model=str(ck.path), drafters=parse_drafters(drafters))
            cache[drafters] = LocalEngine(config.replace(min_tree_confidence=0.0, adaptive=False), checkpoint=ck)
        return cache[drafters]

    return get


def constrained_reference(ck, tokenizer, prompt: list[int], spec: StructuredOutput, n: int) -> list[int]:
    """Plain greedy decoding with the grammar's mask on HF's logits, one token at a time."""
    import llguidance.torch as llg_torch

    hf = ck.load_hf_model()
    compiler = GrammarCompiler(tokenizer, ck.config.vocab_size)
    matcher = compiler.matcher(spec)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        mask = llg_torch.allocate_token_bitmask(1, ck.config.vocab_size)
        llg_torch.fill_next_token_bitmask(matcher, mask, 0)
        llg_torch.apply_token_bitmask_inplace(row[None], mask)
        token = int(row.argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return out


def test_json_schema_greedy_equals_constrained_plain_decoding(engines, ck):
    tok = engines("none").tokenizer
    prompts = [encode_prompt(tok, t) for t in ("Describe a pet.", "JSON only: a fish")]
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=spec)
    outs = {d: engines(d).generate(prompts, params) for d in ("none", "ngram,suffix", "ngram,self")}
    for i, prompt in enumerate(prompts):
        want = constrained_reference(ck, tok, prompt, spec, MAX_TOKENS)
        assert [outs[d][i].new_token_ids for d in outs] == [want] * len(outs)
        text = tok.decode(want, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert outs["none"][i].finish_reason == "stop"
    assert any(o.stats.num_accepted_tokens > 0 for o in outs["ngram,self"])  # drafts still paid


def test_choice_regex_and_seeded_sampling_under_grammar(engines):
    tok = engines("none").tokenizer
    prompt = encode_prompt(tok, "Pick one.")
    for spec, check in ((StructuredOutput("choice", json.dumps(["alpha", "beta gamma"])),
                         lambda t: t in ("alpha", "beta gamma")),
                        (StructuredOutput("regex", r"[0-9]{3}-[a-c]{2}"),
                         lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit())):
        for params in (SamplingParams(max_tokens=20, structured=spec),
                       SamplingParams(max_tokens=20, structured=spec, temperature=1.0, seed=4)):
            texts = [tok.decode(engines(d).generate([prompt], params)[0].new_token_ids, skip_special_tokens=True)
                     for d in ("none", "ngram,self")]
            assert texts[0] == texts[1] and check(texts[0]), texts


def test_a_schema_the_engine_cannot_compile_is_refused_by_name(engines):
    core = engines("none").core
    with pytest.raises(ValueError, match="json schema cannot be compiled.*foo"):
        core.check_request([1, 2], SamplingParams(structured=StructuredOutput("json_schema", '{"type": "foo"}')))
    with pytest.raises(ValueError, match="regex cannot be compiled"):
        core.check_request([1, 2], SamplingParams(structured=StructuredOutput("regex", "a(b")))


ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999}, "status": {"enum": ["pending", "shipped", "delivered"]},
    "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["id", "status", "items"], "additionalProperties": False}


@pytest.fixture(scope="module")
def real_engines(real_checkpoint):
    """The embedded SmolLM2 as served: the default config (priced trees, the guard), with the
    default drafters and with none."""
    base = EngineConfig()
    return {d: LocalEngine(base.replace(drafters=parse_drafters(d)), checkpoint=real_checkpoint)
            for d in ("default", "none")}


def test_real_model_greedy_is_the_same_with_and_without_drafters_under_each_grammar(real_engines, real_checkpoint):
    """SmolLM2 under a JSON schema, a regex and a choice: the default drafters (forced tokens
    ahead of them, their paths pruned, masks only where the walk goes) commit plain decoding's
    text, which for the schema is HF's greedy under llguidance's full mask token by token; and
    with no drafter, the forced tokens alone commit more than a token a step."""
    tok = real_engines["none"].tokenizer
    order = StructuredOutput("json_schema", json.dumps(ORDER))
    cases = [(order, "Write a JSON order about a late delivery. Answer with JSON only.", 80),
             (StructuredOutput("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3} (apples|pears)"), "Name a fruit order.", 24),
             (StructuredOutput("choice", json.dumps(["positive", "neutral", "negative"])),
              "Is 'great food, slow service' positive, neutral or negative?", 8)]
    for spec, text, max_tokens in cases:
        prompt = encode_prompt(tok, text)
        params = SamplingParams(max_tokens=max_tokens, structured=spec)
        outs = {d: e.generate([prompt], params)[0] for d, e in real_engines.items()}
        assert outs["default"].new_token_ids == outs["none"].new_token_ids, spec.kind
        if spec is order:
            assert outs["none"].new_token_ids == constrained_reference(real_checkpoint, tok, prompt, spec, max_tokens)
            jsonschema.validate(json.loads(tok.decode(outs["none"].new_token_ids, skip_special_tokens=True)), ORDER)
            stats = outs["none"].stats
            assert len(outs["none"].new_token_ids) / stats.num_verify_steps > 1.5
            assert stats.accepted_by.get("grammar", 0) > 10
