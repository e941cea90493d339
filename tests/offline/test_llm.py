"""The offline API (``from cosine_ray import LLM, SamplingParams``): text, token-id and chat
prompts batched through the engine, vLLM's sampling fields mapped or refused, outputs in
vLLM's shapes, the progress bar; greedy output equal to the engine's own plain decoding.

Fast tests run on a tiny random model with a byte-level tokenizer built in code
(``support.byte_tokenizer``); the ``real_model`` ones on the embedded SmolLM2 against HF
transformers' greedy decoding.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from support.byte_tokenizer import save_byte_tokenizer
from support.hf_reference import hf_greedy
from support.tiny_checkpoint import write_tiny_checkpoint

from cosine_ray import LLM, SamplingParams
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams as EngineParams

PROMPTS = ["The sea is", "Once upon a time", "def add(a, b):", "Twinkle, twinkle"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    """A tiny random model with a byte-level tokenizer and a plain chat template (no EOS:
    greedy output runs to max_tokens)."""
    path = tmp_path_factory.mktemp("offline") / "tiny-text"
    write_tiny_checkpoint(path, vocab_size=256, seed=11)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    """Speculating with drafters whose drafts the target accepts (the target drafting for
    itself: deep trees every step) and the n-gram drafter."""
    return LLM(str(tiny_text_model), drafters="ngram,self")


@pytest.fixture(scope="module")
def plain(tiny_text_model):
    """The same model without drafters: the engine's own plain decoding."""
    return LocalEngine(EngineConfig(model=str(tiny_text_model), drafters=()))


def plain_greedy(plain, prompt_ids: list[list[int]], max_tokens: int, **kw):
    return plain.generate(prompt_ids, EngineParams(max_tokens=max_tokens, temperature=0.0, **kw))


def encode(llm, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=True)["input_ids"]


def test_package_import_needs_neither_ray_nor_torch():
    code = ("import sys; import cosine_ray; from cosine_ray import LLM, SamplingParams; "
            "print(sorted(m for m in ('ray', 'torch', 'fastapi') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_generate_equals_plain_decoding_and_speculates(llm, plain):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [encode(llm, p) for p in PROMPTS]
    want = plain_greedy(plain, [o.prompt_token_ids for o in outs], 24)
    for out, ref in zip(outs, want):
        (c,) = out.outputs
        assert c.token_ids == ref.new_token_ids and len(c.token_ids) == 24
        assert c.text == llm.tokenizer.decode(ref.new_token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length" and c.stop_reason is None and c.logprobs is None
    stats = [o.outputs[0].stats for o in outs]
    assert sum(s.num_accepted_tokens for s in stats) > 0  # speculation ran, and it was lossless
    assert all(s.mean_accepted_length > 1 and s.num_verify_steps < 24 for s in stats)
    assert len({o.request_id for o in outs}) == len(outs)


def test_speculation_is_on_by_default(tiny_text_model):
    from cosine_ray.engine.config import DEFAULT_DRAFTERS
    from cosine_ray.offline.llm import engine_config

    assert engine_config(str(tiny_text_model), {}).drafters == parse_drafters(DEFAULT_DRAFTERS)
    config = engine_config(str(tiny_text_model), {"drafters": "none", "num_speculative_tokens": 3,
                                                 "max_model_len": 512, "experiments": {"adaptive": False}})
    assert config.drafters == () and config.num_speculative_tokens == 3 and config.max_model_len == 512
    assert config.experiments.adaptive is False


def test_requests_are_batched_together(llm, monkeypatch):
    """Every prompt of the batch is in the engine at once (continuous batching), not one after
    another."""
    core = llm.engine.core
    step, most = core.step, []

    async def counting_step(lane):
        most.append(len(core.running) + len(core.waiting))
        return await step(lane)

    monkeypatch.setattr(core, "step", counting_step)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert max(most) == len(PROMPTS)


def test_generate_from_inside_a_running_event_loop(llm, plain):
    """A notebook cell runs in an event loop: the batch then runs on a thread of its own."""
    async def cell():
        return llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)

    (out,) = asyncio.run(cell())
    assert out.outputs[0].token_ids == plain_greedy(plain, [[1, 2, 3]], 24)[0].new_token_ids


def test_token_id_prompts(llm, plain):
    ids = [encode(llm, p) for p in PROMPTS[:2]]
    forms = llm.generate([ids[0], {"prompt_token_ids": ids[1]}, {"prompt": PROMPTS[1]}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in forms] == [None, None, PROMPTS[1]]
    assert [o.prompt_token_ids for o in forms] == [ids[0], ids[1], ids[1]]
    want = plain_greedy(plain, ids, 24)
    assert [o.outputs[0].token_ids for o in forms] == [want[0].new_token_ids, want[1].new_token_ids,
                                                       want[1].new_token_ids]
    (single,) = llm.generate(ids[0], GREEDY, use_tqdm=False)  # a list of ints is one prompt
    assert single.outputs[0].token_ids == want[0].new_token_ids


def test_n_completions_and_their_seeds(llm, plain):
    (greedy,) = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)
    (want,) = plain_greedy(plain, [greedy.prompt_token_ids], 12)
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert all(c.token_ids == want.new_token_ids for c in greedy.outputs)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    (first,) = llm.generate(PROMPTS[0], sampled, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # each completion its own sampling key
    # completion i samples with seed + i: the same text as one request with that seed, and the
    # same on the engine without drafters (speculation keeps the seeded distribution and its draws)
    (again,) = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=8, max_tokens=12), use_tqdm=False)
    assert again.outputs[0].token_ids == first.outputs[1].token_ids
    (alone,) = plain.generate([first.prompt_token_ids], EngineParams(max_tokens=12, temperature=1.0, seed=9))
    assert alone.new_token_ids == first.outputs[2].token_ids


def test_stop_strings_and_stop_tokens(llm):
    (full,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    at = next(k for k in range(1, len(text) - 2) if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    stop = text[at:at + 2]
    (cut,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=["@@never@@", stop],
                                                     logprobs=0), use_tqdm=False)
    c = cut.outputs[0]
    assert c.text == text[:at] and c.finish_reason == "stop" and c.stop_reason == stop
    # the tokens end at the one that completed the stop string, the log-probabilities with them
    assert c.token_ids == ids[:len(c.token_ids)] and len(c.token_ids) < len(ids)
    assert stop in llm.tokenizer.decode(c.token_ids) and stop not in llm.tokenizer.decode(c.token_ids[:-1])
    assert len(c.logprobs) == len(c.token_ids)
    token = ids[5]
    (by_token,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token]),
                               use_tqdm=False)
    c = by_token.outputs[0]
    assert c.token_ids == ids[:ids.index(token) + 1] and c.finish_reason == "stop" and c.stop_reason == token


def test_logprobs_equal_the_plain_engines(llm, plain):
    (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=1),
                          use_tqdm=False)
    c = out.outputs[0]
    (ref,) = plain_greedy(plain, [out.prompt_token_ids], 10, logprobs=3, prompt_logprobs=1)
    assert len(c.logprobs) == 10
    for token_id, position, want in zip(c.token_ids, c.logprobs, ref.logprobs):
        assert next(iter(position)) == token_id  # the chosen token first, then the alternatives
        assert abs(position[token_id].logprob - want.logprob) < 1e-4
        assert position[token_id].rank == 1  # greedy: the most likely token
        assert list(position) == [t for t, _ in want.top]
        assert max(abs(position[t].logprob - v) for t, v in want.top) < 1e-4
        assert position[token_id].decoded_token == llm.tokenizer.decode([token_id])
    assert abs(c.cumulative_logprob - sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs))) < 1e-6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(next(iter(p)) == t for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))


def test_structured_outputs(llm):
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16,
                                                    structured_outputs={"choice": ["yes", "no way"]}), use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no way") and o.outputs[0].finish_reason == "stop" for o in outs)


def test_chat_renders_the_template(llm, plain):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    conversations[1] = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [f"<user>{PROMPTS[0]}\n<assistant>", "<system>Be brief.\n<user>a\nb\n<assistant>"]
    for out in outs:
        assert out.prompt_token_ids == llm.tokenizer(out.prompt, add_special_tokens=False)["input_ids"]
    want = plain_greedy(plain, [o.prompt_token_ids for o in outs], 24)
    assert [o.outputs[0].token_ids for o in outs] == [w.new_token_ids for w in want]
    (one,) = llm.chat(conversations[0], GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")
    assert one.prompt == PROMPTS[0] + "!"


def test_progress_bar_on_stderr(llm, capsys):
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output: " in err and "toks/s" in err
    assert "tokens/step: " in err
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("field, value", [
    ("min_p", 0.1), ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("best_of", 2),
    ("logits_processors", [print]), ("bad_words", ["x"]), ("allowed_token_ids", [1]), ("detokenize", False),
    ("truncate_prompt_tokens", 4), ("guided_decoding", {"json": {}}), ("top_p", 0.0), ("n", 0),
    ("logit_bias", {"5": 1.0}), ("stop", [""]),
])
def test_sampling_fields_we_do_not_honour_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_fields_and_bad_inputs_are_refused(llm, tiny_text_model):
    with pytest.raises(TypeError, match="no_such_field"):
        SamplingParams(no_such_field=1)
    with pytest.raises(ValueError, match="no_such_key"):
        LLM(str(tiny_text_model), no_such_key=1)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="one key"):
        llm.generate({"prompt": "a", "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate([1] * llm.max_model_len, SamplingParams(max_tokens=None), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("x", SamplingParams(max_tokens=llm.max_model_len), use_tqdm=False)
    with pytest.raises(ValueError, match="tools"):
        llm.chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}],
                 use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)


def test_model_without_tokenizer_takes_token_ids(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint.path), drafters="ngram")
    assert llm.tokenizer is None
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, logprobs=1), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.text == "" and next(iter(c.logprobs[0].values())).decoded_token is None
    for bad in ("text", {"prompt": "text"}):
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop="x"), use_tqdm=False)


def test_the_python_api_page_documents_every_sampling_field():
    page = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text(encoding="utf-8")
    missing = [f.name for f in fields(SamplingParams) if f.init and f"`{f.name}`" not in page]
    assert not missing, f"docs/python-api.md does not document SamplingParams' fields {missing}"


# ---- the embedded SmolLM2 --------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?",
         "Give me three colours.", "What is 12 times 7?", "Name a famous physicist.",
         "Translate 'good morning' into Spanish.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m")  # the default drafter set: speculation on


@pytest.mark.real_model
def test_chat_equals_hf_greedy_8_of_8(smol, real_hf_model):
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    outs = smol.chat(conversations, SamplingParams(max_tokens=24, temperature=0))
    tokenizer = smol.tokenizer
    same = 0
    for conversation, out in zip(conversations, outs):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert out.prompt_token_ids == ids
        want = tokenizer.decode(hf_greedy(real_hf_model, ids, 24), skip_special_tokens=True)
        same += out.outputs[0].text == want
    assert same == len(CHATS), f"{same}/{len(CHATS)} equal HF greedy"
    assert sum(o.outputs[0].stats.num_verify_steps for o in outs) > 0


@pytest.mark.real_model
def test_generate_64_prompts_completes_with_the_bar(smol, capsys):
    from cosine_ray.datasets import domain_prompts

    prompts = [row["prompt"] for domain in ("code", "math", "instruction", "chat")
               for row in domain_prompts(domain)[:16]]
    assert len(prompts) == 64
    outs = smol.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert len(outs) == 64 and [o.prompt for o in outs] == prompts
    assert all(o.outputs[0].finish_reason in ("stop", "length") and o.outputs[0].token_ids for o in outs)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "64/64" in err
