"""Grammars are compiled once per spec, in a worker thread, with a size and a time cap: the step
loop that drives every other request never waits on a compile (fakes: ``TableTarget`` and an
llguidance tokenizer of its vocabulary, ``support.grammar_tokenizer``)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.owners.grammars import GrammarCompiler
from cosine_ray.engine.request import RequestRefused, SamplingParams, StructuredOutput

from support.factories import engine_config
from support.fakes import VOCAB, TableTarget
from support.grammar_tokenizer import EOS, decode, grammar_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}
SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))


class GatedCompiler(GrammarCompiler):
    """Building the grammar of a spec whose text contains "gated" waits until ``gate`` opens
    (5 s at most): a compile as long as the test needs. ``released`` says whether the gate
    opened, or the wait ran out."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.released: list[bool] = []

    def grammar(self, spec: StructuredOutput) -> str:
        if "gated" in spec.value:
            self.released.append(self.gate.wait(5.0))
        return super().grammar(spec)


def make(compiler: GrammarCompiler | None = None, **config) -> EngineCore:
    core = EngineCore(engine_config(num_speculative_tokens=0, **config), TableTarget(), [], vocab_size=VOCAB,
                      eos_token_ids=(EOS,), tokenizer=grammar_tokenizer(), seed=0)
    if compiler is not None:
        core.constraints.compiler = compiler
    return core


def test_a_schema_is_compiled_once_and_every_choice_gets_its_own_matcher():
    core = make()
    loop = EngineLoop(core)
    params = [SamplingParams(max_tokens=24, structured=SPEC, temperature=2.0, seed=s) for s in range(4)]

    async def go():
        await core.prepare_request([1, 2, 3], params[0])  # the ingress's check
        outs = await asyncio.gather(*(loop.generate_all([1, 2, 3], p, f"c{i}") for i, p in enumerate(params)))
        await loop.shutdown()
        return outs

    outs = asyncio.run(go())
    assert core.constraints.compiler.num_compiles == 1  # 1 + 3n before: each check and each choice compiled
    texts = [decode(o.new_token_ids) for o in outs]
    for text in texts:  # each matcher followed its own choice's tokens
        assert set(json.loads(text)) == {"a", "b"}, texts
    assert len(set(texts)) > 1, texts  # four seeds, one shared matcher would have broken some
    other = StructuredOutput("regex", "[a-c]{3}")
    core.check_request([1, 2], SamplingParams(structured=other))
    core.check_request([1, 2], SamplingParams(structured=SPEC))
    assert core.constraints.compiler.num_compiles == 2


def test_the_step_loop_runs_while_a_grammar_compiles():
    """A stream without a grammar runs to its end while another request's grammar (and the
    ingress's check of it) compiles; only then is the compile let through. Before, the compile
    ran on the event loop: the stream got no step until the gate's wait ran out."""
    compiler = GatedCompiler(grammar_tokenizer(), VOCAB)
    core = make(compiler)
    loop = EngineLoop(core)
    gated = StructuredOutput("json_schema", json.dumps({**SCHEMA, "description": "gated"}))
    steps_while_compiling = []
    step = core.step

    async def counting(lane=None):
        if not compiler.gate.is_set():
            steps_while_compiling.append(len(core.running))
        return await step(lane)

    core.step = counting

    async def bystander():
        out = await loop.generate_all([5, 6, 7], SamplingParams(max_tokens=30), "plain")
        compiler.gate.set()
        return out

    async def constrained():
        await asyncio.sleep(0)  # the bystander is in the pool first
        await core.prepare_request([1, 2], SamplingParams(max_tokens=24, structured=gated))
        return await loop.generate_all([1, 2], SamplingParams(max_tokens=24, structured=gated), "json")

    async def go():
        outs = await asyncio.gather(bystander(), constrained())
        await loop.shutdown()
        return outs

    plain, constrained_out = asyncio.run(go())
    assert compiler.released == [True], "the compile held the event loop until its gate's wait ran out"
    assert plain.new_token_ids == TableTarget().greedy([5, 6, 7], 30)
    assert len(steps_while_compiling) >= 30  # every token of the bystander while the grammar compiled
    assert set(json.loads(decode(constrained_out.new_token_ids))) == {"a", "b"}
    assert compiler.num_compiles == 1


def test_a_compile_past_the_time_cap_is_refused_by_the_field():
    compiler = GatedCompiler(grammar_tokenizer(), VOCAB, timeout_s=0.2)
    core = make(compiler)
    gated = StructuredOutput("regex", "gated[a-c]")

    async def go():
        with pytest.raises(RequestRefused) as refused:
            await core.prepare_request([1, 2], SamplingParams(structured=gated))
        compiler.gate.set()
        return refused.value

    refusal = asyncio.run(go())
    assert (refusal.param, refusal.reason) == ("structured", "too_slow")
    assert "within 0.2 s" in str(refusal)


def test_a_grammar_past_the_size_cap_is_refused_by_the_field():
    core = make()
    huge = {"type": "object", "properties": {f"f{i}": {"enum": [f"v{i}{j}" for j in range(8)]} for i in range(10_000)},
            "required": [f"f{i}" for i in range(10_000)]}
    with pytest.raises(RequestRefused) as refused:
        asyncio.run(core.prepare_request([1, 2], SamplingParams(structured=StructuredOutput("json_schema",
                                                                                             json.dumps(huge)))))
    assert (refused.value.param, refused.value.reason) == ("structured", "too_large")
    foo = SamplingParams(structured=StructuredOutput("json_schema", '{"type": "foo"}'))
    for _ in range(2):  # a refusal is cached too: the same answer, at once
        with pytest.raises(RequestRefused) as invalid:
            core.check_request([1, 2], foo)
        assert (invalid.value.param, invalid.value.reason) == ("structured", "invalid")
        assert "foo" in str(invalid.value)
    assert core.constraints.compiler.num_compiles == 2
