"""Every request field of OpenAI's and vLLM's chat and completions APIs, and what we do with it.

``FIELDS`` is the one list: each field is *honoured* (a typed field of the request models in
``serve.schemas``, applied to the output), *accepted* (it cannot change the output: ``user``,
``metadata``, ...), or *refused* unless it has its default value (a 400 naming it). A field
in neither API nor ours is refused as unknown, so nothing a client sends is silently ignored.
``fields_table()`` renders the list for docs/api.md (tests/test_docs.py checks the page).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cosine_ray.serve.errors import InvalidRequest

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
CHAT, COMPLETIONS, BOTH = "chat", "completions", "both"
_UNSET = object()


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    routes: str
    """chat | completions | both."""
    source: str
    """Who defines it: OpenAI, vLLM, or cosine_ray."""
    policy: str
    """honoured | accepted | refused."""
    note: str = ""
    defaults: tuple[Any, ...] = (None,)
    """Values a refused field may still have (its default: the client did not ask for anything)."""

    def applies_to(self, route: str) -> bool:
        return self.routes in (route, BOTH)


def _h(name: str, routes: str, source: str, note: str) -> Field:
    return Field(name, routes, source, HONOURED, note)


def _a(name: str, routes: str, source: str, note: str = "cannot change the output") -> Field:
    return Field(name, routes, source, ACCEPTED, note)


def _r(name: str, routes: str, source: str, *defaults: Any, note: str = "not implemented") -> Field:
    return Field(name, routes, source, REFUSED, note, (None, *defaults))


O, V, OV, C = "OpenAI", "vLLM", "OpenAI, vLLM", "cosine_ray"
FIELDS: tuple[Field, ...] = (
    _h("model", BOTH, OV, "a served model's name (another is a 404); omitted: the first"),
    _h("messages", CHAT, OV, "roles system, developer (as system), user, assistant (with tool_calls), tool"),
    _h("prompt", COMPLETIONS, OV, "a string or token ids, or a batch of either (choice i·n + j is prompt i's j-th)"),
    _h("max_tokens", BOTH, OV, "tokens to generate"),
    _h("max_completion_tokens", CHAT, OV, "alias of max_tokens; wins when both are given"),
    _h("temperature", BOTH, OV, "0 = greedy"),
    _h("top_p", BOTH, OV, ""),
    _h("top_k", BOTH, V, "0 or -1 = off"),
    _h("n", BOTH, OV, "choices; they share the prompt's KV, each with its own sampling key"),
    _h("best_of", COMPLETIONS, OV, "best_of ≥ n choices generated, the n with the highest log-probability returned"),
    _h("stream", BOTH, OV, "server-sent events; choices interleaved by index"),
    _h("stream_options", BOTH, OV, "include_usage, continuous_usage_stats"),
    _h("seed", BOTH, OV, "reproducible sampling, with or without speculation (choice i uses seed + i)"),
    _h("stop", BOTH, OV, "up to 4 strings; the text ends before the first, the usage and "
       "log-probabilities at the token that completed it (as vLLM)"),
    _h("stop_token_ids", BOTH, V, "finish at these tokens (kept in the token count, not in the text)"),
    _h("ignore_eos", BOTH, V, "generate exactly max_tokens tokens"),
    _h("min_tokens", BOTH, V, "EOS and stop_token_ids held back until this many tokens"),
    _h("presence_penalty", BOTH, OV, "applied at every draft-tree node from its own path"),
    _h("frequency_penalty", BOTH, OV, "applied at every draft-tree node from its own path"),
    _h("repetition_penalty", BOTH, V, "applied at every draft-tree node from its own path"),
    _h("logit_bias", BOTH, OV, "token id → bias in [-100, 100]"),
    _h("logprobs", BOTH, OV, "chat: true/false; completions: the number of top alternatives (≤ 20)"),
    _h("top_logprobs", CHAT, OV, "alternatives per token (≤ 20); needs logprobs"),
    _h("echo", COMPLETIONS, OV, "prepend the prompt (and its log-probabilities with logprobs)"),
    _h("prompt_logprobs", BOTH, V, "log-probabilities of the prompt tokens (vLLM's response field)"),
    _h("response_format", BOTH, OV, "text, json_object, json_schema (strict or not): grammar-constrained"),
    _h("structured_outputs", BOTH, V, "json, regex, choice, grammar (Lark or GBNF), json_object"),
    _h("tools", CHAT, OV, "function tools, rendered into the prompt"),
    _h("tool_choice", CHAT, OV, "none, auto, required, or a named function"),
    _h("parallel_tool_calls", CHAT, OV, "false: at most one call with tool_choice required"),
    _h("chat_template_kwargs", CHAT, V, "variables for the chat template (at most 32; not the names of "
       "apply_chat_template's own arguments)"),
    _h("prediction", BOTH, O, "Predicted Outputs (also on completions): drafted from, never forced; "
       "at most the model's context in tokens; usage counts accepted and rejected prediction tokens"),
    _h("cosine_ray_stats", BOTH, C, "add this request's speculation statistics"),
    _a("user", BOTH, OV), _a("metadata", CHAT, O), _a("store", CHAT, O),
    _a("safety_identifier", CHAT, O), _a("prompt_cache_key", CHAT, O),
    _a("prompt_cache_retention", CHAT, O), _a("prompt_cache_options", CHAT, O),
    _a("service_tier", CHAT, O), _a("request_id", BOTH, V), _a("session_id", BOTH, V),
    _a("stream_interval", BOTH, V, "every token is streamed as it is verified"),
    _a("include_reasoning", CHAT, V, "no reasoning parser: all text is content"),
    _r("audio", CHAT, O), _r("modalities", CHAT, O, ["text"]),
    _r("functions", CHAT, O, note="deprecated by OpenAI: use tools"),
    _r("function_call", CHAT, O, "none", note="deprecated by OpenAI: use tool_choice"),
    _r("web_search_options", CHAT, O), _r("reasoning_effort", CHAT, OV), _r("verbosity", CHAT, O),
    _r("moderation", CHAT, O),
    _r("suffix", COMPLETIONS, OV, ""),
    _r("use_beam_search", BOTH, V, False), _r("min_p", BOTH, V, 0, 0.0), _r("watermarking", BOTH, V, False),
    _r("length_penalty", BOTH, V, 1, 1.0), _r("include_stop_str_in_output", BOTH, V, False),
    _r("skip_special_tokens", BOTH, V, True), _r("spaces_between_special_tokens", BOTH, V, True),
    _r("truncate_prompt_tokens", BOTH, V), _r("truncation_side", BOTH, V),
    _r("logprob_token_ids", BOTH, V), _r("allowed_token_ids", BOTH, V), _r("bad_words", BOTH, V, []),
    _r("add_generation_prompt", CHAT, V, True), _r("continue_final_message", CHAT, V, False),
    _r("add_special_tokens", CHAT, V, False), _r("add_special_tokens", COMPLETIONS, V, True),
    _r("documents", CHAT, V), _r("chat_template", CHAT, V, note="the server's template (--chat-template) only"), 
    _r("media_io_kwargs", CHAT, V), _r("mm_processor_kwargs", CHAT, V), _r("prompt_embeds", COMPLETIONS, V),
    _r("priority", BOTH, V, 0, note="no priority scheduling"),
    _r("return_tokens_as_token_ids", BOTH, V, False), _r("return_token_ids", BOTH, V, False),
    _r("routed_experts_prompt_start", BOTH, V, 0), _r("return_token_offsets", BOTH, V, False),
    _r("return_prompt_text", CHAT, V, False), _r("return_mm_kwargs", BOTH, V, True),
    _r("cache_salt", BOTH, V, note="the prefix cache is not salted"),
    _r("kv_transfer_params", BOTH, V), _r("ec_transfer_params", BOTH, V), _r("vllm_xargs", BOTH, V),
    _r("repetition_detection", BOTH, V), _r("thinking_token_budget", BOTH, V),
)


def fields_for(route: str) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if f.applies_to(route)}


def check_extra_fields(route: str, extras: Mapping[str, Any]) -> None:
    """400 naming the first field that is refused with a non-default value, or unknown.
    ``extras``: the request's fields that are not typed fields of its model."""
    known = fields_for(route)
    for name, value in extras.items():
        field = known.get(name)
        if field is None:
            raise InvalidRequest(f"unknown field {name!r}: this server refuses fields it does not know rather "
                                 f"than ignore them (docs/api.md lists every field)", param=name)
        if field.policy == REFUSED and not any(_same(value, d) for d in field.defaults):
            raise InvalidRequest(f"{name} is not supported by this server ({field.note}); leave it out", param=name)


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default or value is default


def fields_table() -> str:
    """The markdown table of every field (docs/api.md, between its generated-table markers)."""
    rows = ["| field | from | chat | completions | what the server does |", "| --- | --- | --- | --- | --- |"]
    seen: dict[str, list[Field]] = {}
    for f in FIELDS:
        seen.setdefault(f.name, []).append(f)
    for name, fields in seen.items():
        on = {route: next((f for f in fields if f.applies_to(route)), None) for route in (CHAT, COMPLETIONS)}
        first = fields[0]
        what = {HONOURED: "honoured", ACCEPTED: "accepted, no effect", REFUSED: "400 unless default"}
        cells = [what[on[r].policy] if on[r] else "—" for r in (CHAT, COMPLETIONS)]
        notes = "; ".join(dict.fromkeys(f.note for f in fields if f.note))
        defaults = sorted({repr(d) for f in fields if f.policy == REFUSED for d in f.defaults if d is not None})
        if defaults:
            notes = (notes + "; " if notes else "") + "default " + ", ".join(defaults)
        rows.append(f"| `{name}` | {first.source} | {cells[0]} | {cells[1]} | {notes} |")
    return "\n".join(rows)
