"""Tool-call parsers (``serve.text.tool_parsers`` through ``serve.text.tools.parse_tool_calls``) on what
each format's own chat template writes for an assistant's tool call: Llama 3.1's and Mistral 7B
v0.3's templates (``chat_templates/``, with their provenance) rendered by transformers'
``apply_chat_template``, and the Hermes form ``serve.text.tools.render`` writes. The model's text is
the rendered assistant turn without its end token, with and without the special tokens a
decode may skip. Streaming: the content sent before the calls is never part of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.byte_tokenizer import SIMPLE_CHAT_TEMPLATE, byte_tokenizer

from cosine_ray.serve.text import tools
from cosine_ray.serve.schemas import ChatCompletionRequest
from cosine_ray.serve.text.tool_parsers import TOOL_CALL_PARSERS, tool_call_parser
from cosine_ray.serve.text.tools import parse_tool_calls

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris", "unit": "c"}
USER = {"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}


def assistant_turn(template: str, calls: list[dict], **special_tokens: str) -> str:
    """What ``template`` writes for an assistant message making ``calls`` (after the prompt)."""
    tokenizer = byte_tokenizer(**special_tokens)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.get("id", "call00000"), "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}} for call in calls]}
    prompt = tokenizer.apply_chat_template([USER], chat_template=template, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template([USER, message], chat_template=template, tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):]


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed[1]]


def streamed_content(text: str, parser: str) -> list[str]:
    """The content a stream sends as ``text`` grows one character at a time: up to where the
    calls begin, or else all but what may still begin one (``serve.choices.ChatDeltas``)."""
    sent = []
    for end in range(len(text) + 1):
        prefix = text[:end]
        start = tools.call_start(prefix, 0, parser)
        sent.append(prefix[:start] if start >= 0 else prefix[:len(prefix) - tools.held_back(prefix, parser)])
    return sent


def check_stream(text: str, parser: str, content: str | None) -> None:
    sent = streamed_content(text, parser)
    assert all(a == b[:len(a)] for a, b in zip(sent, sent[1:])), "content sent is never taken back"
    assert (content or "").startswith(sent[-1].strip()) and sent[-1].strip() == (content or "").strip()


# ---- Llama 3.1 ---------------------------------------------------------------------------------

def test_llama3_json_on_llama_31s_template():
    template = (TEMPLATES / "llama-3.1-instruct-excerpt.jinja").read_text()
    turn = assistant_turn(template, [{"name": "get_weather", "arguments": PARIS}],
                          bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert turn == '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}<|eot_id|>'
    text = turn.removesuffix("<|eot_id|>")  # the end token finishes the request; it is no text
    for form in (text, "<|python_tag|>" + text, "\n " + text + "\n"):
        parsed = parse_tool_calls(form, "llama3_json", TOOLS)
        assert parsed[0] is None and calls_of(parsed) == [("get_weather", PARIS)]
        check_stream(form, "llama3_json", None)
    # several calls joined by ";" (Llama 3.2's form), "arguments" as well as "parameters"
    other = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    parsed = parse_tool_calls(f"{text}; {other}", "llama3_json", TOOLS)
    assert calls_of(parsed) == [("get_weather", PARIS), ("get_time", {"zone": "UTC"})]
    # text before <|python_tag|> is content, and is streamed as such
    parsed = parse_tool_calls("Let me look.<|python_tag|>" + text, "llama3_json", TOOLS)
    assert parsed[0] == "Let me look." and calls_of(parsed) == [("get_weather", PARIS)]
    check_stream("Let me look.<|python_tag|>" + text, "llama3_json", "Let me look.")


def test_llama3_json_leaves_answers_alone():
    for text in ("It is sunny in Paris.",
                 '{"name": "Paris", "parameters": {}}',  # JSON, but no tool of that name
                 '{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
                 'The answer: {"name": "get_weather", "parameters": {}}'):  # a call must lead the text
        assert parse_tool_calls(text, "llama3_json", TOOLS) == (text, [])
    assert parse_tool_calls('{"name": "get_weather", "parameters": {}}; {"name": "nope", "parameters": {}}',
                            "llama3_json", TOOLS)[1] == []
    check_stream("It is sunny in Paris.", "llama3_json", "It is sunny in Paris.")


# ---- Mistral 7B v0.3 ---------------------------------------------------------------------------

def test_mistral_on_mistral_v03s_template():
    template = (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()
    calls = [{"name": "get_weather", "arguments": PARIS, "id": "w8Xq2LmZ0"},
             {"name": "get_time", "arguments": {"zone": "UTC"}, "id": "T1me00042"}]
    turn = assistant_turn(template, calls, bos_token="<s>", eos_token="</s>")
    assert turn.startswith("[TOOL_CALLS] [") and turn.endswith("]</s>")
    text = turn.removesuffix("</s>")
    decoded_without_specials = text.replace("[TOOL_CALLS]", "")  # a decode that skips special tokens
    for form in (text, decoded_without_specials, "Checking both. " + text):
        content, parsed = parse_tool_calls(form, "mistral", TOOLS)
        assert calls_of((content, parsed)) == [("get_weather", PARIS), ("get_time", {"zone": "UTC"})]
        assert [c.id for c in parsed] == ["w8Xq2LmZ0", "T1me00042"]  # the ids the template carries
        assert content == ("Checking both." if form.startswith("Checking") else None)
        check_stream(form, "mistral", content)
    # a call without an id gets one Mistral's template takes back: 9 letters or digits
    (call,) = parse_tool_calls('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "mistral", TOOLS)[1]
    assert len(call.id) == 9 and call.id.isalnum()
    again = [{"name": call.function.name, "arguments": json.loads(call.function.arguments), "id": call.id}]
    assert assistant_turn(template, again, bos_token="<s>", eos_token="</s>").startswith("[TOOL_CALLS]")


def test_mistral_leaves_answers_alone():
    for text in ("[1] is a citation.", '[{"name": "unknown", "arguments": {}}]', "[TOOL_CALLS] [{\"name\": \"get_",
                 "Sure, here you go."):
        assert parse_tool_calls(text, "mistral", TOOLS) == (text, [])
    check_stream("Sure, here you go.", "mistral", "Sure, here you go.")


# ---- Hermes (the default) ----------------------------------------------------------------------

def test_hermes_round_trips_what_render_writes():
    """A model without a tool template is asked for Hermes calls (``tools.render``), and its
    earlier calls are written back the same way: what render writes, the parser reads."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}
    req = ChatCompletionRequest(model="m", tools=TOOLS, messages=[
        USER, {"role": "assistant", "content": "One moment.", "tool_calls": [call]}])
    messages, native_tools = tools.render(req, tokenizer)
    assert native_tools is None and "<tool_call>" in messages[0]["content"]  # the preamble asks for them
    text = messages[-1]["content"]
    assert text.startswith("One moment.\n<tool_call>\n")
    parsed = parse_tool_calls(text, tools=TOOLS)  # hermes is the default
    assert parsed[0] == "One moment." and calls_of(parsed) == [("get_weather", PARIS)]
    assert tools.parse(req, text)[1][0].function.name == "get_weather"
    check_stream(text, "hermes", "One moment.")
    assert parse_tool_calls(text, "hermes", ["get_time"]) == (text, [])  # a name not offered is no call


def test_parser_registry():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral"):
        tool_call_parser("pythonic")
    # tools may be names, OpenAI dicts or None (any name)
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert calls_of(parse_tool_calls(text, tools=["f"])) == calls_of(parse_tool_calls(text)) == [("f", {"x": 1})]
    assert parse_tool_calls(text, tools=[])[1] == []
