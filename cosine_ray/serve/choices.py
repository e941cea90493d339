"""The choices of one API request: their engine generations, streamed together, and the
OpenAI shapes of what they produced (text, log-probabilities, tool calls).

``interleave`` runs every choice's generation at once and yields each step of any of them as it
arrives (OpenAI interleaves streamed choices by ``index``). ``Logprobs`` turns the engine's
``TokenLogprob``s into the chat, completions and vLLM ``prompt_logprobs`` shapes. ``ChatDeltas``
is one streamed chat choice: content deltas, or tool-call deltas when tools decide the output.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.serve import tools
from cosine_ray.serve.generation import Generation
from cosine_ray.serve.schemas import (ChatCompletionRequest, ChatDelta, ChatLogprobs, CompletionLogprobs,
                                      FunctionDelta, ToolCallDelta, TokenLogprobOut, TopLogprob)


@dataclass(slots=True)
class Choice:
    index: int
    gen: Generation
    first: str = ""
    """The text of its first engine output (awaited before the response starts)."""


async def interleave(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, str, list[TokenLogprob], bool]]:
    """(choice, text delta, new log-probabilities, whether it was the choice's last) for every
    step of every choice, as they come; the first step of each is its ``first``. Errors of any
    choice are raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(choice: Choice) -> None:
        try:
            await queue.put((choice, choice.first, choice.gen.take_logprobs(), choice.gen.is_done))
            while not choice.gen.is_done:
                delta = await choice.gen.step()
                await queue.put((choice, delta, choice.gen.take_logprobs(), choice.gen.is_done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((choice, exc, None, True))
        finally:
            await queue.put((choice, None, None, True))

    tasks = [asyncio.ensure_future(run(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            choice, delta, logprobs, last = await queue.get()
            if delta is None:
                remaining -= 1
            elif isinstance(delta, BaseException):
                raise delta
            else:
                yield choice, delta, logprobs, last
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Logprobs:
    """The OpenAI shapes of log-probabilities, with token texts from ``tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        out = []
        for lp in logprobs:
            token = self.text(lp.token_id)
            out.append(TokenLogprobOut(token=token, logprob=lp.logprob, bytes=list(token.encode()),
                                       top_logprobs=[TopLogprob(token=(t := self.text(i)), logprob=v,
                                                                bytes=list(t.encode())) for i, v in lp.top]))
        return ChatLogprobs(content=out)

    def completion(self, logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                   offset: int = 0) -> CompletionLogprobs:
        """``token_ids`` are the tokens (the first prompt token has no log-probability: None);
        ``offset``: the text's length before them (``text_offset``)."""
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs):
            token = self.text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self.text(i): v for i, v in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def vllm_prompt(self, prompt_logprobs: Sequence[TokenLogprob | None] | None) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token {token id: {logprob, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        out: list[dict | None] = []
        for lp in prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": self.text(lp.token_id)}}
            for i, v in lp.top:
                entry.setdefault(str(i), {"logprob": v, "decoded_token": self.text(i)})
            out.append(entry)
        return out


@dataclass(slots=True)
class ChatDeltas:
    """One streamed chat choice's deltas under its tool mode (``serve.tools``)."""

    req: ChatCompletionRequest
    text: str = ""
    sent: int = 0
    """Characters of ``text`` sent as content."""
    calls: int = 0
    """Tool-call deltas sent."""
    in_call: bool = False
    has_calls: bool = field(default=False)

    def feed(self, delta: str) -> ChatDelta | None:
        self.text += delta
        kind = tools.mode(self.req)
        if kind == "named":
            if not delta and self.calls:
                return None
            first = self.calls == 0
            self.calls, self.has_calls = 1, True
            name = self.req.tool_choice.function.name
            return ChatDelta(tool_calls=[ToolCallDelta(
                index=0, id=f"call_{id(self):x}" if first else None, type="function" if first else None,
                function=FunctionDelta(name=name if first else None, arguments=delta))])
        if kind == "required" or self.in_call:
            return None
        if kind == "auto":
            at = self.text.find(tools.OPEN_TAG, self.sent)
            if at >= 0:
                self.in_call = True
                return self._content(at)
            return self._content(len(self.text) - tools.held_back(self.text))
        return self._content(len(self.text))

    def _content(self, end: int) -> ChatDelta | None:
        if end <= self.sent:
            return None
        delta, self.sent = self.text[self.sent:end], end
        return ChatDelta(content=delta)

    def finish(self) -> list[ChatDelta]:
        """What is left at the end: the tool calls (``required``, ``auto``), or held-back text."""
        kind = tools.mode(self.req)
        if kind in ("none", "named"):
            return []
        content, calls = tools.parse(self.req, self.text)
        if not calls:
            rest = self._content(len(self.text))
            return [rest] if rest else []
        self.has_calls = True
        out = []
        if kind == "auto" and content and not self.sent:
            out.append(ChatDelta(content=content))
        for i, call in enumerate(calls):
            out.append(ChatDelta(tool_calls=[ToolCallDelta(index=i, id=call.id, type="function", function=FunctionDelta(
                name=call.function.name, arguments=call.function.arguments))]))
        return out
