"""OpenAI-compatible request/response models for /v1/chat/completions and /v1/completions.

Validation here is structural (types, ranges, shapes); ``check_supported`` then rejects what is
valid OpenAI but not served by a lossless engine (n > 1, penalties, logprobs, tools, ...).
Numbers and booleans are strict: ``"16"`` is not a max_tokens and ``true`` is not a number.
Union-typed fields (message content, prompt, stop) are checked by hand so an error names the
field itself, never a pydantic union branch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from cosine_ray.serve.errors import InvalidRequest

MAX_STOP_STRINGS = 4

StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)]

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}
_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"},
                          {"type": "array", "items": {"type": "string", "minLength": 1},
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
    include_usage: StrictBool = False
    """Send one more chunk before [DONE] with ``usage`` and no choices."""


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The served model's id; omitted = the served model.")
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Tokens to generate; omitted = min(server default, remaining context).")
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1)] = Field(-1, description="0 or -1 = off.")
    n: Annotated[int, Field(strict=True, ge=1)] = Field(1, description="Only 1 is supported.",
                                                        json_schema_extra={"maximum": 1})
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), lt=2**64)] | None = None
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = Field(
        None, validate_default=True, description="Up to 4 stop strings: the output ends before the first one.")
    presence_penalty: Penalty = Field(0.0, description="Only 0 is supported (lossless output).")
    frequency_penalty: Penalty = Field(0.0, description="Only 0 is supported (lossless output).")
    user: str | None = None
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
        for s in stops:
            check_unicode(s)
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise InvalidRequest (naming the field) for valid OpenAI we do not serve."""
        if self.n != 1:
            raise InvalidRequest("n > 1 is not supported; send one request per completion", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise InvalidRequest(f"{name} is not supported (only 0): the server returns the target "
                                     f"model's own distribution (lossless speculative decoding)", param=name)
        for name, value in (self.model_extra or {}).items():
            is_default = value in (None, False, [], {}, "none", {"type": "text"}) or (
                name == "best_of" and value == 1)
            if name in _UNSUPPORTED_EXTRAS and not is_default:
                raise InvalidRequest(f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")


# Known OpenAI fields whose non-default value would change the output we cannot honour.
_UNSUPPORTED_EXTRAS = frozenset({"tools", "tool_choice", "functions", "function_call", "logit_bias",
                                 "response_format", "best_of", "echo", "suffix", "top_logprobs",
                                 "prediction", "audio", "modalities"})


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(
        ..., description="A string or a list of {type: 'text', text} parts (joined with newlines).")
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str:
        if isinstance(value, str):
            return check_unicode(value)
        if isinstance(value, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in value):
            return check_unicode("\n".join(p["text"] for p in value))
        raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Alias of max_tokens; wins when both are given.")
    logprobs: StrictBool | None = Field(None, description="Not supported: true is rejected.")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported", param="logprobs")


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = Field(
        ..., description="A string, a list of one string, or a list of token ids.")
    logprobs: Annotated[int, Field(strict=True, ge=0)] | None = Field(None, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return check_unicode(value)
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and all(isinstance(t, str) for t in value):
            raise ValueError("only one prompt per request is supported")
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported", param="logprobs")


# ---- responses ------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's and vLLM's field)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CosineRayStats(BaseModel):
    """Speculation statistics of one request (the `cosine_ray_stats` extension)."""

    num_draft_tokens: int
    num_accepted_tokens: int
    """Accepted draft tokens (bonus excluded)."""
    mean_accepted_length: float
    """Tokens committed per verify step, bonus included."""
    num_verify_steps: int
    drafted_by: dict[str, int]
    accepted_by: dict[str, int]
    domain: str
    """The domain the engine classified the prompt into (code, math, instruction, chat, other)."""
    drafters_used: list[str]
    """Drafters that put at least one token into this request's verified trees (sorted)."""
    pipedec_timesteps: int = 0
    """Timesteps the request ran in PipeDec mode (``pipeline_mode: pipedec``, alone in the pool)."""
    pipedec_tokens: int = 0
    """Tokens those timesteps committed; ``pipedec_hits`` of them were in the prediction tree."""
    pipedec_hits: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    num_preemptions: int = 0
    """Times the engine preempted the request for KV memory (it resumed with the same text)."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    cosine_ray: CosineRayStats | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    cosine_ray: CosineRayStats | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    cosine_ray: CosineRayStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cosine_ray"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
