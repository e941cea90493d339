"""vLLM's ``/tokenize`` and ``/detokenize``: their request and response shapes, and the work.

``/tokenize`` takes a ``prompt`` (vLLM's TokenizeCompletionRequest) or ``messages`` (its
TokenizeChatRequest, rendered through the chat template as ``/v1/chat/completions`` renders them)
and answers ``{count, max_model_len, tokens[, token_strs]}``; ``/detokenize`` takes ``tokens`` and
answers ``{prompt}``. Both are bounded as the generation routes are (``serve.guards.limits``, the text
bound of ``serve.text.prompts``) and run the tokenizer off the event loop (``serve.text.prompts.off_loop``).
A field vLLM has and we do not honour is refused unless it has its default.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cosine_ray.serve.errors import InvalidRequest
from cosine_ray.serve.guards.limits import MAX_MESSAGES, MAX_TOOLS, check_token_ids
from cosine_ray.serve.text.prompts import chat_prompt, check_length, off_loop
from cosine_ray.serve.schemas import ChatCompletionRequest, ChatMessage, ToolParam, check_unicode
from cosine_ray.serve.state import ServerState

StrictBool = Annotated[bool, Field(strict=True)]


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (``prompt``) and TokenizeChatRequest (``messages``) as one
    body: exactly one of the two. ``add_special_tokens`` defaults as vLLM's do: true for a prompt,
    false for messages (the chat template writes its own)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A served model's id; omitted = the first served model.")
    prompt: str | None = Field(None, description="The text to tokenize (or give messages).")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool | None = Field(
        None, description="Add the tokenizer's special tokens (default: true for prompt, false for messages).")
    add_generation_prompt: StrictBool | None = Field(
        None, description="messages: open the assistant's turn (default: unless continue_final_message).")
    continue_final_message: StrictBool = Field(
        False, description="messages: leave the last message open (not with add_generation_prompt).")
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: StrictBool | None = Field(False, description="Also return each token's string.")
    chat_template: str | None = Field(None, description="Not supported: the model's own template is used.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Not supported.")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | None) -> str | None:
        return None if value is None else check_unicode(value)

    def check_supported(self) -> None:
        """400 naming the field: both or neither of prompt and messages, chat fields with a
        prompt, both ways of ending the chat, or a field we do not honour."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give prompt or messages (exactly one)", param="prompt")
        chat_only = ("add_generation_prompt", "continue_final_message", "tools")
        if self.prompt is not None:
            for name in chat_only:
                if getattr(self, name) not in (None, False):
                    raise InvalidRequest(f"{name} applies to messages, not to prompt", param=name)
        if self.continue_final_message and self.add_generation_prompt is True:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 param="continue_final_message")
        for name in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported on /tokenize; the model's own chat template is used",
                                     param=name)

    def chat_request(self) -> ChatCompletionRequest:
        """The messages (and tools) as a chat completion request, to render them the same way."""
        chat = ChatCompletionRequest.model_construct(messages=list(self.messages or ()), tools=self.tools)
        chat.check_supported()
        return chat


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A served model's id; omitted = the first served model.")
    tokens: list[Annotated[int, Field(strict=True)]] = Field(..., description="Token ids to decode.")


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    """``req``'s token ids with the model's tokenizer (its chat template for messages)."""
    req.check_supported()
    if req.messages is not None:
        ids = await chat_prompt(state, req.chat_request(),
                                add_generation_prompt=(not req.continue_final_message if req.add_generation_prompt
                                                       is None else req.add_generation_prompt),
                                continue_final_message=req.continue_final_message,
                                add_special_tokens=bool(req.add_special_tokens))
    else:
        check_length(state, len(req.prompt or ""), "prompt")
        add_special = req.add_special_tokens is not False
        encoded = await off_loop(state.tokenizer, req.prompt, add_special_tokens=add_special)
        ids = [int(t) for t in encoded["input_ids"]]
    strs = await off_loop(state.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
                            token_strs=None if strs is None else [str(t) for t in strs])


async def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``req.tokens`` (special tokens kept, so a tokenized prompt comes back whole).
    At most the model's context of ids, each in the vocabulary."""
    context = state.engine.max_model_len
    if len(req.tokens) > context:
        raise InvalidRequest(f"tokens: {len(req.tokens)} ids, more than the model's context of {context}",
                             param="tokens")
    check_token_ids(req.tokens, state.engine.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await off_loop(state.tokenizer.decode, req.tokens))
