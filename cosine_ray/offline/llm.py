"""``LLM``: the offline API, as vLLM's ``LLM`` (``from cosine_ray import LLM, SamplingParams``).

The engine runs in this process, without Ray (``engine.local.LocalEngine``), with speculation
on by default (the default drafter set) and output identical to the target's own decoding.
``generate`` takes text or token ids, ``chat`` conversations through the model's chat template;
both hand every request of the batch to the engine loop at once (continuous batching: the
engine runs ``max_num_seqs`` of them and admits the next as one finishes), show a progress bar
over the batch, and return one ``RequestOutput`` per prompt in input order.

Each completion is one engine request seen as text by the serving layer's ``Generation``
(incremental detokenization, stop strings that end the request in the engine), so the offline
and the HTTP paths give the same text for the same request.
"""

from __future__ import annotations

import asyncio
import itertools
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from cosine_ray.engine.config import EngineConfig, config_from_dict
from cosine_ray.offline.outputs import CompletionOutput, RequestOutput, logprobs_list
from cosine_ray.offline.params import SamplingParams

T = TypeVar("T")

PROGRESS_DESC = "Processed prompts"


def engine_config(model: str, engine_args: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **engine_args)``: the keys of a config file
    (docs/configuration.md); an unknown key is a ValueError naming it."""
    if "model" in engine_args:
        raise ValueError("give the model once, as LLM's first argument")
    try:
        return config_from_dict({"model": model, **engine_args})
    except ValueError as exc:
        raise ValueError(f"LLM(): {exc}") from None


@dataclass(slots=True)
class _Job:
    """One prompt of a batch and its completions' engine parameters."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    choice_params: list[Any]
    """``engine.request.SamplingParams``, one per completion."""


class LLM:
    """A model and its engine in this process. ``engine_args`` are configuration keys:
    ``drafters``, ``num_speculative_tokens``, ``max_model_len``, ``max_num_seqs``, ``device``,
    ``dtype``, ``num_threads``, ``experiments={...}``, ..."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        from cosine_ray.engine.local import LocalEngine  # torch: loaded with a model, not with the package
        self.engine = LocalEngine(engine_config(model, engine_args))
        self.tokenizer = self.engine.tokenizer
        """The model's Hugging Face tokenizer; None for a checkpoint without one (token ids only)."""
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.core.config.max_model_len

    # ---- the two entry points -------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Complete ``prompts``: a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``, or a list of these. Text is tokenized as is (with the
        tokenizer's BOS), not through the chat template. ``sampling_params``: one for all, or
        one per prompt; None: ``SamplingParams()``."""
        inputs = [self._prompt(p) for p in _prompt_list(prompts)]
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable[..., Any] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of
        them, each rendered by the model's chat template (or ``chat_template``, a Jinja string)
        with ``chat_template_kwargs`` and ``tools`` (function tools in OpenAI's shape, for a
        template that renders them; the output is text, tool calls are not parsed)."""
        inputs = [self._render(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               template_kwargs=dict(chat_template_kwargs or {}), tools=tools)
                  for c in _conversations(messages)]
        return self._run(inputs, sampling_params, use_tqdm)

    # ---- prompts ---------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.engine.checkpoint.name} has no tokenizer: give prompts as token ids")
        if not isinstance(text, str) or not text:
            raise ValueError("a text prompt must be a non-empty string")
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        if not ids:
            raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
        return ids

    def _prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if len(prompt) != 1 or next(iter(prompt)) not in ("prompt", "prompt_token_ids"):
                raise ValueError(f"a prompt dict takes one key, prompt or prompt_token_ids; got {sorted(prompt)}")
            key, prompt = next(iter(prompt.items()))
            if key == "prompt_token_ids" and not _is_token_ids(prompt):
                raise ValueError("prompt_token_ids must be a non-empty list of token ids")
            if key == "prompt" and not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if _is_token_ids(prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _render(self, conversation: Sequence[Mapping[str, Any]], *, chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool, template_kwargs: dict[str, Any],
                tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.engine.checkpoint.name} has no tokenizer, so no chat template")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"model {self.engine.checkpoint.name} has no chat template: pass chat_template= "
                             "or use generate()")
        if tools and "tools" not in template:
            raise ValueError("the chat template does not render tools; leave tools out or pass a chat_template "
                             "that does")
        from jinja2 import TemplateError
        try:
            text = self.tokenizer.apply_chat_template(
                [_message(m, i) for i, m in enumerate(conversation)], tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tools=list(tools) if tools else None, **template_kwargs)
        except TemplateError as exc:
            raise ValueError(f"the conversation does not fit the chat template: {str(exc).splitlines()[0]}") from None
        return text, [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    # ---- running a batch -----------------------------------------------------------------------
    def _run(self, inputs: list[tuple[str | None, list[int]]], sampling_params: Any,
             use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        jobs = [self._job(text, ids, sp) for (text, ids), sp in zip(inputs, _params_list(sampling_params, len(inputs)))]
        return _run_sync(self._generate_all(jobs, _Progress(use_tqdm, len(jobs))))

    def _job(self, text: str | None, ids: list[int], sampling: SamplingParams) -> _Job:
        """Checked before any request starts: a bad prompt fails the call, not the batch halfway."""
        max_tokens = sampling.max_tokens or self.max_model_len - len(ids)
        if max_tokens < 1:
            raise ValueError(f"the prompt is {len(ids)} tokens; the model's context is {self.max_model_len} tokens")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        choice_params = [sampling.engine_params(max_tokens, i) for i in range(sampling.n)]
        self.engine.core.check_request(ids, choice_params[0])
        return _Job(str(next(self._request_ids)), text, ids, sampling, choice_params)

    async def _generate_all(self, jobs: list[_Job], progress: "_Progress") -> list[RequestOutput]:
        from cosine_ray.engine.client import LocalEngineClient
        from cosine_ray.serve.errors import InvalidRequest, OpenAIError
        from cosine_ray.serve.generation import Generation

        client = LocalEngineClient(self.engine)
        tokenizer = self.tokenizer or _NoText()
        gens = [[Generation(client, tokenizer, job.prompt_token_ids, params, job.sampling.stop_strings,
                            job.request_id if job.sampling.n == 1 else f"{job.request_id}-{i}")
                 for i, params in enumerate(job.choice_params)] for job in jobs]

        async def run(job: _Job, choices: list[Any]) -> None:
            try:
                await asyncio.gather(*(g.collect() for g in choices))
            finally:
                await asyncio.gather(*(g.aclose() for g in choices), return_exceptions=True)
            progress.done(len(job.prompt_token_ids), choices)

        tasks = [asyncio.ensure_future(run(job, choices)) for job, choices in zip(jobs, gens)]
        try:
            await asyncio.gather(*tasks)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None
        except OpenAIError as exc:
            raise RuntimeError(exc.message) from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.engine.loop.shutdown()
            progress.close()
        return [self._output(job, choices) for job, choices in zip(jobs, gens)]

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _output(self, job: _Job, choices: list[Any]) -> RequestOutput:
        sampling = job.sampling
        with_logprobs = sampling.logprobs is not None
        outputs = [CompletionOutput(
            index=i, text=g.text.text, token_ids=list(g.text.token_ids),
            cumulative_logprob=g.cumulative_logprob if with_logprobs else None,
            logprobs=logprobs_list(g.logprobs, self._decode_token) if with_logprobs else None,
            finish_reason=g.finish_reason, stop_reason=_stop_reason(g, sampling), stats=g.stats)
            for i, g in enumerate(choices)]
        prompt_logprobs = (logprobs_list(choices[0].prompt_logprobs, self._decode_token)
                           if sampling.prompt_logprobs is not None else None)
        return RequestOutput(job.request_id, job.prompt, job.prompt_token_ids, prompt_logprobs, outputs)


class _Progress:
    """vLLM's bar over a batch: prompts done, and input/output tokens per second so far; ours
    adds the tokens a verify step committed on average, the bonus token included (what
    speculation gains: ``RequestStats.mean_accepted_length`` over the batch)."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int) -> None:
        self.bar = None
        if use_tqdm:
            if callable(use_tqdm):
                factory = use_tqdm
            else:
                from tqdm import tqdm as factory
            self.bar = factory(total=total, desc=PROGRESS_DESC, dynamic_ncols=True,
                               postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.start = time.perf_counter()
        self.num_prompt_tokens = self.num_output_tokens = self.num_steps = self.num_accepted = 0

    def done(self, num_prompt_tokens: int, choices: Sequence[Any]) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        for g in choices:
            self.num_output_tokens += g.num_tokens
            if g.stats is not None:
                self.num_steps += g.stats.num_verify_steps
                self.num_accepted += g.stats.num_accepted_tokens
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        per_step = (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0
        self.bar.postfix = (f"est. speed input: {self.num_prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.num_output_tokens / elapsed:.2f} toks/s, "
                            f"tokens/step: {per_step:.2f}")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _NoText:
    """The text of a model without a tokenizer: empty (its outputs are token ids)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def _run_sync(coro: Awaitable[T]) -> T:
    """Run ``coro`` to its end from synchronous code; from inside a running event loop (a
    notebook cell) in a thread of its own, since that loop cannot be re-entered."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value))


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a prompt or a non-empty list of prompts")
    return list(prompts)


def _conversations(messages: Any) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, Sequence) and messages and all(isinstance(m, Mapping) for m in messages):
        return [list(messages)]
    if (isinstance(messages, Sequence) and messages and all(
            isinstance(c, Sequence) and c and all(isinstance(m, Mapping) for m in c) for c in messages)):
        return [list(c) for c in messages]
    raise ValueError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
                     "or a non-empty list of conversations")


def _message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A message for the template: text parts joined with newlines (as the HTTP layer does)."""
    if not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}] needs a role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                             "are supported")
        content = "\n".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "content": content}


def _params_list(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {num_prompts} (one per prompt)")
    return params


def _stop_reason(gen: Any, sampling: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the completion."""
    if gen.finish_reason != "stop" or not gen.text.token_ids:
        return None
    if gen.text.is_stopped:
        decoded = gen.text.tokenizer.decode(gen.text.token_ids, skip_special_tokens=True)
        return next((s for s in sampling.stop_strings if decoded.startswith(s, len(gen.text.text))), None)
    last = gen.text.token_ids[-1]
    return last if last in (sampling.stop_token_ids or ()) else None
