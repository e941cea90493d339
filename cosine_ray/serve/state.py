"""What every route of the OpenAI app reads: one ``ServerState``, kept on ``app.state.server``.

``build_openai_app`` makes it once per app; a route takes it as a ``State`` parameter (a FastAPI
dependency reading ``request.app.state.server``), so a route is a plain module-level function
of its request and this state, testable alone against a state built from fakes.
"""

from __future__ import annotations

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

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: min(this, context left after the prompt)."""


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
    created: int = field(default_factory=lambda: int(time.time()))
    """The model card's ``created`` (when the app was built)."""

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served model (None: the client left it to us)."""
        if model is not None and model != self.model_name:
            raise NotFound(f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def wants_stats(self, req: Any) -> bool:
        return self.return_spec_stats or req.cosine_ray_stats

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)


def server_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (a FastAPI dependency)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
"""A route parameter of this type receives the app's ``ServerState``."""
