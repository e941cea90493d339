"""OpenAI-compatible request/response models for /v1/chat/completions and /v1/completions.

Validation here is structural (types, ranges, shapes); ``check_supported`` then rejects the
fields ``serve.fields`` refuses (and unknown ones) and inconsistent combinations.
Numbers and booleans are strict: ``"16"`` is not a max_tokens and ``true`` is not a number.
Union-typed fields (message content, prompt, stop) are checked by hand so an error names the
field itself, never a pydantic union branch. Every field that costs work is bounded
(``serve.guards.limits``). The request's nested objects (response formats,
vLLM's structured outputs, function tools, the ``logit_bias`` map) are here too; the response
models live in ``serve.responses`` and are importable from here.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from cosine_ray.engine.request import StructuredOutput
from cosine_ray.serve.errors import InvalidRequest
from cosine_ray.serve.fields import check_extra_fields
from cosine_ray.serve.guards.limits import (MAX_CHOICE_STRINGS, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_PROMPT_GENERATIONS,
                                            MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS,
                                            MAX_USER_CHARS, check_grammar_text, check_schema,
                                            check_schema_chars, json_depth)
from cosine_ray.serve.responses import (  # noqa: F401 - the response models, importable from here too
    AssistantMessage, CalledFunction, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionResponse, CompletionTokensDetails,
    CosineRayStats, ErrorBody,
    ErrorResponse, FinishReason, FunctionDelta, ModelCard, ModelList, PromptTokensDetails, TokenLogprobOut,
    ToolCall, ToolCallDelta, TopLogprob, Usage)

MAX_CHOICES = 16
"""Largest ``n`` / ``best_of``."""
MAX_LOGPROBS = 20
"""Most alternatives per token (OpenAI's limit for top_logprobs)."""
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_DEPTH = 8
MAX_TEMPLATE_KWARGS_CHARS = 16 << 10
"""Bounds of ``chat_template_kwargs``: variables, nesting, and size as JSON."""
TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)]

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                             "maxItems": MAX_PROMPT_GENERATIONS},
                            _TOKEN_IDS_SCHEMA,
                            {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1,
                             "maxItems": MAX_PROMPT_GENERATIONS}]}
_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}, {"type": "null"},
                          {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                           "maxItems": MAX_STOP_STRINGS}]}


def check_unicode(text: str) -> str:
    """``text`` if it is valid Unicode; ValueError naming the first lone UTF-16 surrogate.

    JSON may escape a lone surrogate (``"\\ud800"``) although it is no character: such text
    cannot be encoded to UTF-8, so no tokenizer can take it. The validators below call this
    on every string that reaches the tokenizer or the stop-string matcher, so the client gets
    a 400 naming its field instead of a tokenizer error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: lone UTF-16 surrogate U+{ord(text[exc.start]):04X} at "
                         f"character {exc.start} (a \\uD800-\\uDFFF escape must be half of a pair)") from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    """Send one more chunk before [DONE] with ``usage`` and no choices."""
    continuous_usage_stats: StrictBool = False
    """vLLM: ``usage`` so far on every chunk too."""


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the client expects the answer to be (a file it asks
    to edit). It only speeds the answer up; the text is the model's whatever it says."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(
        ..., description="A string or a list of {type: 'text', text} parts (concatenated).")

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str:
        if isinstance(value, str):
            return check_unicode(value)
        if isinstance(value, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return check_unicode("".join(p["text"] for p in value))
        raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (one of its constraints)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, max_length=MAX_CHOICE_STRINGS)
    grammar: str | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def token_id_map(value: Any) -> list[tuple[int, float]]:
    """``logit_bias``: {"token id": bias in [-100, 100]} → [(id, bias)]; one token given twice
    (``"1"`` and ``"01"``) is refused, as is more than ``MAX_LOGIT_BIAS`` entries."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out, seen = [], {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys are token ids (strings of digits), got {key[:32]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{key[:32]}] must be a number in [-100, 100]")
        token = int(key)
        if token in seen:
            raise ValueError(f"token {token} is given twice ({seen[token][:32]!r} and {key[:32]!r})")
        seen[token] = key
        out.append((token, float(bias)))
    return out


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions requests (``serve.fields`` lists every field)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    route: ClassVar[str] = "both"

    model: str | None = Field(None, description="The served model's id; omitted = the served model.")
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Tokens to generate; omitted = min(server default, remaining context).")
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1)] = Field(-1, description="0 or -1 = off.")
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_CHOICES)] = Field(1, description="Choices to generate.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), lt=2**64)] | None = None
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = Field(
        None, validate_default=True, description="Up to 4 stop strings: the output ends before the first one.")
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    min_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.01, le=10.0)] = 1.0
    logit_bias: Annotated[Any, WithJsonSchema({"type": "object", "additionalProperties": {"type": "number"}})] = Field(
        None, validate_default=True, description="Token id → bias in [-100, 100].")
    prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    prediction: Prediction | None = Field(
        None, description="Predicted Outputs: text the answer is expected to repeat (drafted from, never forced).")
    cosine_ray_stats: StrictBool = Field(
        False, description="Add a `cosine_ray` block with this request's speculation statistics.")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        for s in stops:
            check_unicode(s)
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> list[tuple[int, float]]:
        return token_id_map(value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        """Raise InvalidRequest (naming the field) for fields we refuse (``serve.fields``)."""
        check_extra_fields(self.route, self.model_extra or {})
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
        if self.response_format is not None and self.structured_outputs is not None \
                and self.response_format.type != "text":
            raise InvalidRequest("give response_format or structured_outputs, not both", param="structured_outputs")
        so = self.structured_outputs
        if so is not None and sum(x is not None and x is not False for x in
                                  (so.json_, so.regex, so.choice, so.grammar, so.json_object)) != 1:
            raise InvalidRequest("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                                 param="structured_outputs")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise InvalidRequest("response_format type json_schema needs json_schema", param="response_format")
        self._check_grammar_size()

    def _check_grammar_size(self) -> None:
        """The bounds of ``serve.guards.limits`` on schemas and grammars."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.json_schema is not None:
            check_schema(rf.json_schema.schema_, "response_format")
        if so is None:
            return
        if so.json_ is not None:
            check_schema(so.json_, "structured_outputs")
        for text, what in ((so.regex, "regex"), (so.grammar, "grammar")):
            if text is not None:
                check_grammar_text(text, "structured_outputs", what)
        if so.choice is not None:
            check_grammar_text("".join(so.choice), "structured_outputs", "choice list")

    @property
    def structured(self) -> tuple[StructuredOutput, str] | None:
        """The grammar this request asks for, and the field that asked for it."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            return StructuredOutput("json_schema", json.dumps({"type": "object"})), "response_format"
        if rf is not None and rf.type == "json_schema":
            return StructuredOutput("json_schema", json.dumps(rf.json_schema.schema_)), "response_format"
        if so is None:
            return None
        if so.json_ is not None:
            text = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            return StructuredOutput("json_schema", text), "structured_outputs"
        if so.json_object:
            return StructuredOutput("json_schema", json.dumps({"type": "object"})), "structured_outputs"
        if so.regex is not None:
            return StructuredOutput("regex", so.regex), "structured_outputs"
        if so.choice is not None:
            return StructuredOutput("choice", json.dumps(so.choice)), "structured_outputs"
        return StructuredOutput("lark", so.grammar), "structured_outputs"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(
        None, description="A string or a list of {type: 'text', text} parts (joined with newlines).")
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, str):
            return check_unicode(value)
        if isinstance(value, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in value):
            return check_unicode("\n".join(p["text"] for p in value))
        raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")


class ChatCompletionRequest(_SamplingRequest):
    route: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Alias of max_tokens; wins when both are given.")
    logprobs: StrictBool | None = Field(None, description="Return each token's log-probability.")
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables for the chat template (e.g. enable_thinking), as vLLM's.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if not value:
            return value
        if len(value) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} template variables, got {len(value)}")
        bad = next((k for k in value if not TEMPLATE_VARIABLE.fullmatch(k)), None)
        if bad is not None:
            raise ValueError(f"{bad[:32]!r} is not a template variable name (letters, digits, _)")
        if json_depth(value) > MAX_TEMPLATE_KWARGS_DEPTH:
            raise ValueError(f"nested more than {MAX_TEMPLATE_KWARGS_DEPTH} deep")
        if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"more than {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON")
        return value

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise InvalidRequest(f"messages[{i}].content is required", param=f"messages[{i}].content")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequest(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                                 param="tool_choice")
        if self.tools:
            schemas = [t.function.parameters or {} for t in self.tools]
            for schema in schemas:
                check_schema(schema, "tools")
            check_schema_chars(sum(len(json.dumps(p)) for p in schemas), "tools")  # all tools together
        if self.tools and self.tool_choice not in (None, "none") and self.structured is not None:
            raise InvalidRequest("tool_choice and a response format cannot both constrain the output",
                                 param="tool_choice")


class CompletionRequest(_SamplingRequest):
    route: ClassVar[str] = "completions"

    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = Field(
        ..., description="A string or a list of token ids; or a batch: a list of strings or of token-id lists "
                         "(the choices of prompt i are indexed i·n + j).")
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Return each token's log-probability and this many alternatives.")
    echo: StrictBool = False
    best_of: Annotated[int, Field(strict=True, ge=1, le=MAX_CHOICES)] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int] | list[str] | list[list[int]]:
        """A string or token ids; a batch of several is a list of strings or of token-id lists
        (a batch of one is its one prompt)."""
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return check_unicode(value)
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a non-empty string, a list of token ids, a list of strings "
                             "or a list of token-id lists")
        if all(type(t) is int for t in value):
            return value
        if len(value) > MAX_PROMPT_GENERATIONS:
            raise ValueError(f"at most {MAX_PROMPT_GENERATIONS} prompts in one request, got {len(value)}")
        if all(isinstance(p, str) for p in value):
            if not all(value):
                raise ValueError("prompt strings must not be empty")
            prompts = [check_unicode(p) for p in value]
        elif all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in value):
            prompts = value
        else:
            raise ValueError("prompt must be a string, a list of token ids, a list of strings or a list of "
                             "token-id lists (non-empty, one kind)")
        return prompts[0] if len(prompts) == 1 else prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch's in order."""
        p = self.prompt
        return [p] if isinstance(p, str) or type(p[0]) is int else list(p)

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_generated(self) -> int:
        return max(self.best_of or 1, self.n)

    def check_supported(self) -> None:
        super().check_supported()
        generations = len(self.prompts) * self.num_generated
        if generations > MAX_PROMPT_GENERATIONS:
            raise InvalidRequest(f"{len(self.prompts)} prompts × {self.num_generated} choices is {generations} "
                                 f"generations; a request may ask for at most {MAX_PROMPT_GENERATIONS}",
                                 param="prompt")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
        if self.best_of not in (None, self.n) and self.stream:
            raise InvalidRequest("best_of > n cannot be streamed", param="best_of")
