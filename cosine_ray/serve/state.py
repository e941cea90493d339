"""What every route of the OpenAI app reads: one ``ServerState``, kept on ``app.state.server``.

``build_openai_app`` makes it once per app; a route takes it as a ``State`` parameter (a FastAPI
dependency reading ``request.app.state.server``), so a route is a plain module-level function
of its request and this state, testable alone against a state built from fakes.

An app may serve several models (``ServedModel``: an engine, its tokenizer and the names a
request may call it by; the Ray Serve LLM builder makes one per ``llm_configs`` entry) and one
model under several names (vLLM's ``--served-model-name``). A route picks the request's model
with ``for_model``, which returns the state with that model's engine, tokenizer and name in the
fields every later step reads; admission and the HTTP counts stay shared.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from cosine_ray.engine.client import EngineClient
from cosine_ray.serve.errors import NotFound
from cosine_ray.serve.guards.admission import Admission
from cosine_ray.serve.generation import DEFAULT_SEND_TIMEOUT_S, Readiness
from cosine_ray.serve.metrics_http import HttpCounts
from cosine_ray.serve.schemas import ModelCard
from cosine_ray.serve.text.tool_parsers import DEFAULT_TOOL_CALL_PARSER

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: min(this, context left after the prompt)."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model the app serves."""

    names: tuple[str, ...]
    """The ids a request may give it by; responses carry the first (as vLLM's served names)."""
    engine: EngineClient
    """The engine that runs it."""
    tokenizer: Any
    """Its HF tokenizer."""
    readiness: Readiness
    """What ``/health`` knows of its engine."""
    max_token_chars: int | None = None
    """The most characters one of its tokens stands for (``ServerState.max_token_chars``)."""
    eos_token_ids: tuple[int, ...] = ()
    """Its tokenizer's end-of-text ids."""


@dataclass(frozen=True, slots=True)
class ServerState:
    """The engine, the tokenizer and the limits the routes share (frozen: a route cannot swap
    them; the counters inside ``admission``, ``readiness`` and ``http_counts`` do change)."""

    engine: EngineClient
    """The engine the generations run on (local, or the Serve engine deployment's handle)."""
    tokenizer: Any
    """The target's HF tokenizer (chat template, detokenization)."""
    model_name: str
    """The one model id this server serves (another is a 404)."""
    admission: Admission
    """The bound on generations in flight, shared fairly between keys (429 or 503 + Retry-After)."""
    readiness: Readiness
    """What ``/health`` answers, at once."""
    http_counts: HttpCounts
    """This replica's HTTP response counts (``/metrics`` folds them in)."""
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    """max_tokens when a request gives none (capped by the context left)."""
    return_spec_stats: bool = False
    """Add the ``cosine_ray`` stats block to every completion, not only when a request asks."""
    request_timeout_s: float | None = None
    """Longest wall time of one generation from its admission (408 past it); None: no limit."""
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    """Longest a streamed response waits for its client to take bytes (then it is dropped)."""
    max_token_chars: int | None = None
    """The most characters one token stands for (``serve.text.prompts``: a longer text than the
    context times this is refused before tokenizing); None: no such bound."""
    eos_token_ids: tuple[int, ...] = ()
    """The tokenizer's end-of-text ids (``serve.guards.limits.check_vocabulary``)."""
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER
    """The format ``auto`` tool calls are read in (``serve.text.tool_parsers``: hermes, llama3_json,
    mistral; ``--tool-call-parser``)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's (``--chat-template``); None: the
    tokenizer's."""
    created: int = field(default_factory=lambda: int(time.time()))
    """The model card's ``created`` (when the app was built)."""
    models: tuple[ServedModel, ...] = ()
    """Every model served, the first the default (a request that names none); the fields above
    hold the one a request is for (``for_model``). Empty: the one above is the only model, under
    ``model_name`` alone."""

    @property
    def served(self) -> tuple[ServedModel, ...]:
        """Every model served (at least the one in the fields above)."""
        return self.models or (ServedModel((self.model_name,), self.engine, self.tokenizer, self.readiness,
                                           self.max_token_chars, self.eos_token_ids),)

    def for_model(self, model: str | None) -> "ServerState":
        """This state for a request naming ``model`` (None: the first model): that model's
        engine, tokenizer, first name and bounds; 404 for a name no model has."""
        served = self.served
        chosen = served[0] if model is None else next((m for m in served if model in m.names), None)
        if chosen is None:
            names = ", ".join(repr(n) for m in served for n in m.names)
            raise NotFound(f"model {model!r} does not exist; this server serves {names}",
                           param="model", code="model_not_found")
        if chosen.engine is self.engine and chosen.names[0] == self.model_name:
            return self
        return dataclasses.replace(self, engine=chosen.engine, tokenizer=chosen.tokenizer,
                                   model_name=chosen.names[0], readiness=chosen.readiness,
                                   max_token_chars=chosen.max_token_chars, eos_token_ids=chosen.eos_token_ids)

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` names a served model (None: the client left it to us)."""
        self.for_model(model)

    @property
    def template(self) -> str | None:
        """The chat template prompts are rendered with."""
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def wants_stats(self, req: Any) -> bool:
        return self.return_spec_stats or req.cosine_ray_stats

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len,
                         root=getattr(self.engine, "model_name", None))

    def model_cards(self) -> list[ModelCard]:
        """A card for every name of every model, in order."""
        return [ModelCard(id=name, created=self.created, max_model_len=m.engine.max_model_len,
                          root=getattr(m.engine, "model_name", None)) for m in self.served for name in m.names]


def server_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (a FastAPI dependency)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
"""A route parameter of this type receives the app's ``ServerState``."""
