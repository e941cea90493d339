"""Function tools: into the prompt, out of the text, and the grammar of a forced call.

*Rendering*: a chat template that knows tools (it mentions ``tools``) gets them as
``apply_chat_template(tools=...)``; any other template gets them in a system message in the
Hermes format (``<tools>`` JSON, answers as ``<tool_call>{"name", "arguments"}</tool_call>``),
and earlier calls and results in the conversation are written the same way. *Parsing*:
``tool_choice`` named → the whole output is the function's arguments (JSON, constrained by its
``parameters`` schema); ``required`` → a JSON list of ``{"name", "arguments"}`` calls, each
constrained by its function's schema; ``auto`` → the calls the tool-call parser finds in the
text (``serve.text.tool_parsers``: Hermes ``<tool_call>`` blocks by default, Llama 3 JSON or Mistral
``[TOOL_CALLS]``) that name a known function with JSON arguments, the rest stays content (a
model that never writes them simply answers in text); ``none`` → the tools are not rendered.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from cosine_ray.engine.request import StructuredOutput
from cosine_ray.serve.schemas import CalledFunction, ChatCompletionRequest, NamedToolChoice, ToolCall, ToolParam
from cosine_ray.serve.text.tool_parsers import DEFAULT_TOOL_CALL_PARSER, HERMES_OPEN, tool_call_parser

OPEN_TAG = HERMES_OPEN


def mode(req: ChatCompletionRequest) -> str:
    """none | auto | required | named (``tool_choice`` defaults to auto with tools)."""
    if not req.tools or req.tool_choice == "none":
        return "none"
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    return req.tool_choice or "auto"


def template_knows_tools(tokenizer: Any, template: str | None = None) -> bool:
    return "tools" in (template or getattr(tokenizer, "chat_template", None) or "")


def render(req: ChatCompletionRequest, tokenizer: Any,
           template: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, ``tools`` for it or None); ``template``: the one used
    instead of the tokenizer's."""
    native = template_knows_tools(tokenizer, template)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and mode(req) != "none" else None
    messages = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        content = m.content or ""
        if native:
            msg: dict[str, Any] = {"role": role, "content": content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
            continue
        if m.tool_calls:
            calls = "\n".join(f"{OPEN_TAG}\n" + json.dumps({"name": c.function.name,
                                                            "arguments": _json_or_text(c.function.arguments)})
                              + "\n</tool_call>" for c in m.tool_calls)
            content = (content + "\n" if content else "") + calls
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        messages.append({"role": role, "content": content})
    if tools is None or native:
        return messages, tools
    preamble = ("You may call one or more functions to assist with the user query. The functions are "
                "given as JSON signatures within <tools></tools>:\n<tools>\n"
                + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\nFor each function call, return a JSON "
                "object with the function name and arguments within <tool_call></tool_call> tags:\n"
                "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}
    else:
        messages.insert(0, {"role": "system", "content": preamble})
    return messages, None


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters or {"type": "object"}


def grammar(req: ChatCompletionRequest) -> StructuredOutput | None:
    """The constraint of a forced call: named → its arguments; required → a list of calls."""
    kind = mode(req)
    if kind == "named":
        function = next(t.function for t in req.tools if t.function.name == req.tool_choice.function.name)
        return StructuredOutput("json_schema", json.dumps(_parameters(function)))
    if kind == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": _parameters(t.function)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in req.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema))
    return None


def _call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=call_id or tool_call_parser(DEFAULT_TOOL_CALL_PARSER).new_call_id(),
                    function=CalledFunction(name=name, arguments=text))


def parse_tool_calls(text: str, parser: str = DEFAULT_TOOL_CALL_PARSER,
                     tools: Iterable[str | Mapping[str, Any] | ToolParam] | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer in ``parser``'s format (``serve.text.tool_parsers``).
    ``tools``: the functions offered (names, OpenAI tool dicts or ``ToolParam``s); a call of
    any other name is not a call. None: any name. No calls: (text, [])."""
    chosen = tool_call_parser(parser)
    content, calls = chosen.extract(text, None if tools is None else {_tool_name(t) for t in tools})
    return content, [_call(c.name, c.arguments, c.call_id or chosen.new_call_id()) for c in calls]


def _tool_name(tool: str | Mapping[str, Any] | ToolParam) -> str:
    if isinstance(tool, str):
        return tool
    if isinstance(tool, ToolParam):
        return tool.function.name
    return tool["function"]["name"]


def parse(req: ChatCompletionRequest, text: str,
          parser: str = DEFAULT_TOOL_CALL_PARSER) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a finished answer."""
    kind = mode(req)
    if kind == "named":
        return None, [_call(req.tool_choice.function.name, text)]
    if kind == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["arguments"]) for c in calls]
        except (ValueError, TypeError, KeyError):  # cut by max_tokens: not a whole list
            return text, None
    if kind == "auto":
        content, calls = parse_tool_calls(text, parser, req.tools)
        if calls:
            return content, calls
    return text, None


def held_back(text: str, parser: str = DEFAULT_TOOL_CALL_PARSER) -> int:
    """``auto`` streaming: characters at the end of ``text`` that may begin a tool call."""
    return tool_call_parser(parser).held_back(text)


def call_start(text: str, start: int = 0, parser: str = DEFAULT_TOOL_CALL_PARSER) -> int:
    """``auto`` streaming: where tool calls begin in ``text`` at or after ``start``, or -1."""
    return tool_call_parser(parser).call_start(text, start)
