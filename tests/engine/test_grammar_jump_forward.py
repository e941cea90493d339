"""Speculation that pays under a grammar, on the fakes (``TableTarget``, real llguidance matchers
over ``support.grammar_tokenizer``): the tokens a grammar forces join the tree ahead of the
drafters and are accepted with no drafter at all; draft paths are cut at their first token the
grammar forbids; the drafters draft after the forced chain; and a greedy request's walk, which
masks only the rows it visits, commits what fully masked rows commit."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.verify import verify_greedy, verify_greedy_at
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.drafters.base import DraftProposal
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.owners.constraints import GRAMMAR, Constraints, GreedyTokens, forced_tokens, scores
from cosine_ray.engine.owners.grammars import GrammarCompiler
from cosine_ray.engine.owners.verifier import _live_scores
from cosine_ray.engine.request import SamplingParams, StructuredOutput

from support.factories import engine_config, make_request
from support.fakes import VOCAB, FakeDrafter, OracleDrafter, TableTarget
from support.grammar_tokenizer import CHARS, EOS, decode, grammar_tokenizer

SCHEMA = {"type": "object", "properties": {
    "abcdefghij": {"type": "integer", "minimum": 0, "maximum": 99},
    "klmnopqrstu": {"enum": ["yes", "no"]}}, "required": ["abcdefghij", "klmnopqrstu"], "additionalProperties": False}
SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPT = [1, 2, 3]


def t(text: str) -> tuple[int, ...]:
    return tuple(CHARS.index(c) for c in text)


def matcher(spec: StructuredOutput):
    return GrammarCompiler(grammar_tokenizer(), VOCAB).matcher(spec)


def constrained_greedy(prompt: list[int], spec: StructuredOutput, max_tokens: int) -> list[int]:
    """Plain greedy decoding of the ``TableTarget`` under the grammar's full mask, token by token."""
    import llguidance.torch as llg_torch

    target, m, out = TableTarget(), matcher(spec), []
    while len(out) < max_tokens:
        row = target.logits(prompt + out).clone()[None]
        mask = llg_torch.allocate_token_bitmask(1, VOCAB)
        llg_torch.fill_next_token_bitmask(m, mask, 0)
        llg_torch.apply_token_bitmask_inplace(row, mask)
        out.append(int(row.argmax()))
        assert m.consume_token(out[-1])
        if m.is_stopped():
            break
    return out


def generate(drafters, params: SamplingParams, **config):
    core = EngineCore(engine_config(**config), TableTarget(), drafters, vocab_size=VOCAB, eos_token_ids=(EOS,),
                      tokenizer=grammar_tokenizer(), seed=0)
    loop = EngineLoop(core)

    async def go():
        try:
            return await loop.generate_all(PROMPT, params, "r")
        finally:
            await loop.shutdown()

    return asyncio.run(go())


def test_forced_tokens_are_drafted_and_accepted_with_no_drafter():
    """No drafter is configured, yet a step commits several tokens: the schema's keys, quotes
    and braces are forced, join the tree and are accepted; the text is constrained plain decoding's."""
    out = generate([], SamplingParams(max_tokens=60, structured=SPEC))
    want = constrained_greedy(PROMPT, SPEC, 60)
    assert out.new_token_ids == want
    assert set(json.loads(decode(want))) == set(SCHEMA["properties"])
    stats = out.stats
    assert stats.accepted_by.get(GRAMMAR, 0) >= len('{"abcdefghij": ') - 1  # the first key alone
    assert len(want) / stats.num_verify_steps > 3.0, (len(want), stats.num_verify_steps)


def test_forced_tokens_count_even_with_speculation_off():
    out = generate([], SamplingParams(max_tokens=60, structured=SPEC), num_speculative_tokens=0)
    assert out.new_token_ids == constrained_greedy(PROMPT, SPEC, 60)
    assert out.stats.num_verify_steps < len(out.new_token_ids) / 3


class RecordingOracle(OracleDrafter):
    """Drafts the target's unconstrained greedy continuation, and records the contexts it was given."""

    def __init__(self, target: TableTarget) -> None:
        super().__init__("oracle", target)
        self.contexts: list[tuple[int, ...]] = []

    def draft(self, item) -> DraftProposal:
        self.contexts.append(tuple(item.context_token_ids))
        return super().draft(item)


class ForbiddenDrafter(FakeDrafter):
    """Proposes a blank and a letter after every context: tokens the compact schema forbids almost everywhere."""

    def draft(self, item) -> DraftProposal:
        return DraftProposal(item.request_id, [[CHARS.index(" "), CHARS.index("z")]], [[0.9, 0.9]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafters_draft_after_the_forced_chain_and_the_text_is_plain_decodings(temperature):
    oracle = RecordingOracle(TableTarget())
    params = SamplingParams(max_tokens=60, structured=SPEC, temperature=temperature, seed=7)
    out = generate([oracle, ForbiddenDrafter("forbidden")], params, drafters_per_request=2)
    plain = generate([], params)
    assert out.new_token_ids == plain.new_token_ids
    if temperature == 0.0:
        assert out.new_token_ids == constrained_greedy(PROMPT, SPEC, 60)
    # the first token comes from the prompt's row; then the rest of the key is forced, and the
    # first step's drafters continue after it
    assert tuple(PROMPT) + t('{"abcdefghij": ') in oracle.contexts, oracle.contexts[:3]
    assert out.stats.drafted_by.get("forbidden", 0) == 0  # every proposal cut before verification


def test_prune_cuts_each_path_at_its_first_forbidden_token():
    request = make_request(output=(5,))
    request.grammar = matcher(StructuredOutput("regex", "[0-9]{3}:[a-c]{2}"))
    paths = [FusedPath(t("12"), (0.9, 0.8), ("a", "a")), FusedPath(t("1x3"), (0.9, 0.8, 0.7), ("b", "b", "b")),
             FusedPath(t("x1"), (0.9, 0.8), ("c", "c")), FusedPath(t("123:az"), (0.9,) * 6, ("d",) * 6)]
    out = Constraints.prune(request, paths)
    assert [(p.token_ids, p.owners) for p in out] == [(t("12"), ("a", "a")), (t("1"), ("b",)),
                                                      (t("123:a"), ("d",) * 5)]


def test_prune_puts_the_forced_chain_first_and_the_paths_behind_it():
    request = make_request(output=(5,))
    request.grammar = matcher(StructuredOutput("regex", "ab[0-9]{2}"))
    forced = forced_tokens(request, 32)
    assert forced == t("ab")
    out = Constraints.prune(request, [FusedPath(t("1z"), (0.5, 0.5), ("x", "x")),
                                      FusedPath(t("34"), (0.5, 0.25), ("y", "y")), FusedPath(t("a"), (0.5,), ("z",))],
                            forced)
    assert [p.token_ids for p in out] == [t("ab"), t("ab1"), t("ab34")]
    assert out[2].owners == (GRAMMAR, GRAMMAR, "y", "y") and out[2].confidences == (1.0, 1.0, 0.5, 0.25)
    assert forced_tokens(request, 32) == t("ab") and forced_tokens(request, 1) == t("a")  # the matcher is back


def test_the_greedy_walk_masks_what_full_masks_give(seed=0):
    """On random trees (one path the constrained greedy text, the others random tokens), with a
    rule that masks rows whole at times (``min_tokens`` against a grammar that can only end),
    the walk's tokens and dead row are those of the fully masked rows."""
    rng = random.Random(seed)
    target = TableTarget()
    spec = StructuredOutput("regex", "9[a-c]{2,4}")
    dead_rows = 0
    for trial in range(40):
        output = [9] + [CHARS.index(rng.choice("abc")) for _ in range(rng.randrange(0, 3))]
        request = make_request(output=output, max_tokens=40, min_tokens=rng.choice([0, 4, 6]), eos=(EOS,))
        request.grammar = matcher(spec)
        assert request.grammar.consume_tokens(output)
        before = [request.grammar.validate_tokens([x]) for x in range(VOCAB)]
        context = list(request.context_token_ids)
        paths = [tuple(constrained_walk(target, context, request.grammar, 4))]
        paths += [tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))) for _ in range(3)]
        paths += [tuple(CHARS.index(c) for c in rng.choices("abc", k=rng.randrange(1, 5))) for _ in range(3)]
        tree, _ = TokenTree.merge_paths(context[-1], paths)
        node_paths = [()]
        for node in range(1, tree.num_nodes):
            node_paths.append(node_paths[tree.parent_ids[node]] + (tree.token_ids[node],))
        logits = torch.stack([target.logits(context + list(p)) for p in node_paths])
        processed, dead = _live_scores(request, scores(request, logits, tree))
        want = verify_greedy(tree, processed)
        tokens = GreedyTokens(request, logits, tree)
        got = verify_greedy_at(tree, tokens)
        tokens.close()
        want_dead = next((i for i, n in enumerate((0,) + want.accepted_node_ids) if dead is not None and dead[n]), None)
        assert (got, tokens.dead) == (want, want_dead), trial
        assert [request.grammar.validate_tokens([x]) for x in range(VOCAB)] == before  # rolled back
        dead_rows += want_dead is not None
    assert 0 < dead_rows < 40  # both kinds of walk were tried


def constrained_walk(target: TableTarget, context: list[int], m, n: int) -> list[int]:
    """The target's greedy tokens under the grammar's mask after ``context`` (matcher ``m`` there,
    rolled back after): a path the walk follows deep."""
    import llguidance.torch as llg_torch

    path: list[int] = []
    for _ in range(n):
        row = target.logits(context + path).clone()[None]
        mask = llg_torch.allocate_token_bitmask(1, VOCAB)
        llg_torch.fill_next_token_bitmask(m, mask, 0)
        llg_torch.apply_token_bitmask_inplace(row, mask)
        token = int(row.argmax())
        if token == EOS or not m.consume_token(token):
            break
        path.append(token)
    m.rollback(len(path))
    return path
