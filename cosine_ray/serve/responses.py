"""OpenAI-compatible response models of /v1/chat/completions and /v1/completions (and the
error body): what ``serve.openai_app`` sends, plain or as streamed chunks. A tool call
(``ToolCall``) is one of them; a request's assistant messages carry it back."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(..., description="The arguments as a JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's and vLLM's field)."""


class CompletionTokensDetails(BaseModel):
    """OpenAI's details of the completion tokens; sent when the request had a ``prediction``."""

    accepted_prediction_tokens: int = 0
    """Prediction tokens that appear in the completion, in order: the length of the longest
    common subsequence of the prediction and the completion (summed over the choices)."""
    rejected_prediction_tokens: int = 0
    """Prediction tokens that do not: the prediction's length less the accepted ones (per choice)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


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
    engine_replica: str | None = None
    """The engine replica that produced its last tokens (Serve's replica id; absent in process).
    With several replicas a request whose replica died names the one it ended on, and the
    figures above are that replica's alone."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    cosine_ray: CosineRayStats | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    """vLLM's field (``prompt_logprobs``): per prompt token {token id: {logprob, decoded_token}}."""


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


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
    root: str | None = None
    """vLLM's field: the checkpoint the name stands for (``vllm bench serve`` reads it)."""


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
