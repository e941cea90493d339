"""Requests and their sampling parameters: what the engine's request pool holds, who each one is
for (``Tenant``), and how the engine refuses one it cannot serve as asked (``RequestRefused``)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from cosine_ray.algo.logits_rules import RowRules, TokenLogprob

if TYPE_CHECKING:
    from cosine_ray.algo.routing import RoutingVector


class RequestRefused(ValueError):
    """The engine cannot serve a request as it was asked: what the client must change, never
    an engine failure. The front ends map it by ``param`` and ``reason`` (the message is the
    engine's own words, for logs), so what a client reads does not depend on the wording here."""

    def __init__(self, message: str, param: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message)
        self.param = param
        """The request field at fault as the engine names it: ``prompt``, ``structured`` (the
        grammar) or a ``SamplingParams`` field (``max_tokens``, ``logit_bias``, ...); None: the
        request as a whole."""
        self.reason = reason
        """What is wrong with it: ``invalid`` (malformed, or outside the vocabulary), ``context``
        (past the model's length), ``kv_cache`` (does not fit the KV cache even alone),
        ``unsupported`` (this engine cannot serve it at all), ``too_large`` and ``too_slow``
        (a grammar past the compiler's size or time cap)."""

    def __reduce__(self) -> tuple:  # crosses Ray with its fields
        return type(self), (str(self), self.param, self.reason)


REFUSED = "refused"
"""The finish reason of a request the engine ended because its own rules leave no token to
generate (a grammar with ``min_tokens``, ``logit_bias`` or stop ids masking a whole row): the
client's request is at fault, not the engine, and only that request ends."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is for, as the engine's scheduler shares its slots (``engine.owners.pool``)."""

    name: str = ""
    """The API key's name; requests with the same name share one tenant's share ("" included)."""
    user: str = ""
    """OpenAI's ``user`` within the key: the key's share is shared between its users in turn."""


NO_TENANT = Tenant()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    """Upper bound on generated tokens (the bonus token included)."""
    temperature: float = 0.0
    """0 = greedy (token-identical to the target's greedy decoding)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    seed: int | None = None
    """Keys this request's sampling noise (the same seed gives the same text, with or without
    speculation and whatever else is batched with it); None = a random seed."""
    stop_token_ids: tuple[int, ...] = ()
    """Finish when one of these is generated (it is kept in the output, like EOS)."""
    ignore_eos: bool = False
    """Do not finish at EOS (benchmarks that need exact output lengths)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot be generated before this many tokens."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """The penalties of ``algo.logits_rules.RowRules`` (1.0 / 0.0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logits."""
    logprobs: int | None = None
    """Return each generated token's log-probability and its ``logprobs`` most likely
    alternatives (0: the token's own only); None: none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token but the first (the request skips the prefix cache)."""
    structured: "StructuredOutput | None" = None
    """A grammar the output must follow (``engine.owners.constraints``)."""
    prediction: tuple[int, ...] = ()
    """Token ids the client expects the output to be (OpenAI's Predicted Outputs): the
    prediction drafter drafts from them (``engine.drafters.prediction``). They never change the
    text, only how fast it comes; () = none."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestRefused(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestRefused(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestRefused(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestRefused(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestRefused(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}",
                                 "min_tokens")
        if not 0.01 <= self.repetition_penalty <= 100:  # a smaller one overflows the scores to inf
            raise RequestRefused(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}",
                                 "repetition_penalty")
        prediction = tuple(self.prediction)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prediction):
            raise RequestRefused("prediction must be a sequence of token ids (integers >= 0)", "prediction")
        object.__setattr__(self, "prediction", prediction)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise RequestRefused(f"{name} must be None or an integer >= 0, got {value!r}", name)

    def row_rules(self, eos_token_ids: tuple[int, ...]) -> RowRules:
        """The score rules of ``algo.logits_rules`` this request asks for."""
        ends = tuple(self.stop_token_ids) + (() if self.ignore_eos else tuple(eos_token_ids))
        return RowRules(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                        tuple(self.logit_bias), self.min_tokens, ends)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar for the output, as the API gave it (compiled by ``engine.owners.constraints``)."""

    kind: str
    """json_schema | regex | choice | lark."""
    value: str
    """The schema (JSON text), the regex, the choices (a JSON list of strings) or the grammar."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestStats:
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Accepted draft tokens (bonus excluded)."""
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    routed_to: dict[str, int] = field(default_factory=dict)
    """Steps in which routing sent this request to each drafter (expertise routing)."""
    num_routed_steps: int = 0
    """Steps in which the request was routed to drafters at all."""
    domain: str = "other"
    """The request's domain (``Request.domain``), copied here by the engine loop for clients."""
    pipedec_timesteps: int = 0
    """Timesteps this request ran in PipeDec mode (``engine.modes.pipedec``)."""
    pipedec_tokens: int = 0
    """Tokens committed by those timesteps (one per timestep once the root reaches the last stage)."""
    pipedec_hits: int = 0
    """Of those tokens, the ones already in the prediction tree (a miss restarts the tree)."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at admission (not computed)."""
    num_preemptions: int = 0
    """Times the engine preempted it, for KV memory or for another tenant's fair share (it
    resumed by recomputing its context, with the same text)."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step, bonus included (vLLM's convention)."""
        if not self.num_verify_steps:
            return 0.0
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    tenant: Tenant = NO_TENANT
    """Whose request it is (the scheduler's fair share between tenants, then their users)."""
    seed: int | None = None
    """Key of this request's sampling noise (``algo.sampling.sample_keyed``): ``params.seed``, or
    a fresh random one (``draw_seed``, os.urandom) when that is None. Every request gets one;
    greedy requests never use it."""
    num_restores: int = 0
    """Re-prefills after a stage lost the KV (a bug must not loop: ``max_restores``)."""
    lane: int = 0
    """Micro-batch lane the engine steps this request in."""
    admitted_time: float | None = None
    """When the engine moved it from waiting to running (same clock as arrival_time)."""
    domain: str = "other"
    """Domain the engine classified the prompt into (code, math, instruction, chat, other)."""
    stats: RequestStats = field(default_factory=RequestStats)
    # ---- its KV (``engine.owners.kv``) ----------------------------------------------------------
    block_table: list[int] = field(default_factory=list)
    """Pool blocks of its logical KV positions, the same ids on every stage."""
    block_contents: list[int] = field(default_factory=list)
    """Prefix hash of each of its full committed blocks (the prefix cache's chain)."""
    num_computed_tokens: int = 0
    """Tokens of its context whose KV the stages hold (committed)."""
    prefix_looked_up: bool = False
    """The prefix cache was asked for its context since it last held no KV."""
    kv_epoch: int = 0
    """Counts the times its KV was dropped (preemption, a lost stage): a step scheduled before
    that does not verify it."""
    # ---- what the step's owners know about the request: it is freed with the request --------
    num_in_flight: int = 0
    """Steps (lanes) working on it now; its release waits until none does."""
    last_scheduled_at: float | None = None
    """When a step last scheduled it (the scheduler's waiting time)."""
    num_decode_steps: int = 0
    """Decoding steps it was scheduled for (the price's probe steps count them)."""
    decode_steps_at_admission: int = 0
    """``num_decode_steps`` when it was last admitted: a fair-share preemption waits until it
    has run a few steps since (no request is preempted again before it made progress)."""
    holds_kv: bool = False
    """Scheduled at least once: its KV counts against M_max whether it runs or not."""
    gain_curve: tuple[float, ...] = (0.0,)
    """Expected accepted draft tokens of its last drafted tree for γ = 0.. (predicts its next step)."""
    draft_depth: int = 0
    """Depth of its last drafted tree (its deepest node at or above the confidence floor): the
    scheduler's next draft budget follows it (``SpeculationConfig.long_draft_tokens``)."""
    routing: "RoutingVector | None" = None
    """Its routing vector M_r (eq. 2-3), from the domain prior on arrival."""
    drafted_ahead: object | None = None
    """PEARL: what was drafted ahead of its verification (``engine.modes.pearl``)."""
    prompt_key: int | None = None
    """Twins: hash of the prompt, computed once (``engine.modes.twins``)."""
    twin_progress: tuple[int, float] | None = None
    """Twins: its output length and when that last grew."""
    # ---- the rules on its scores (``engine.owners.constraints``) ------------------------------
    rules: RowRules | None = None
    """Penalties, bias and min_tokens; None: none of them (set on arrival)."""
    grammar: Any = None
    """The grammar matcher after its committed output (an ``llguidance.LLMatcher``), or None."""
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """Log-probabilities of the prompt's tokens computed so far (``params.prompt_logprobs``)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.seed is None:
            from cosine_ray.algo.sampling import draw_seed  # here: the ingress imports this module without torch
            self.seed = draw_seed() if self.params.seed is None else int(self.params.seed)
        rules = self.params.row_rules(self.eos_token_ids)
        self.rules = None if rules.is_identity else rules

    @property
    def needs_rows(self) -> bool:
        """Its verification needs the target's logits rows, not only their argmax: a rule
        changes its scores, or it returns log-probabilities."""
        params = self.params
        return (self.rules is not None or self.grammar is not None or params.logprobs is not None
                or params.prompt_logprobs is not None)

    @property
    def context_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append(self, new_token_ids: list[int]) -> list[int]:
        """Append verified tokens, stopping at EOS/stop tokens or max_tokens.

        Returns the tokens actually appended (a suffix past a stop is dropped)."""
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops.update(self.eos_token_ids)
        appended = []
        for tok in new_token_ids:
            self.output_token_ids.append(tok)
            appended.append(tok)
            if self.grammar is not None and self.grammar.consume_token(tok) and self.grammar.is_stopped():
                self.finish("stop")  # the grammar is complete: nothing but EOS could follow
                break
            if tok in stops:
                self.finish("stop")
                break
            if len(self.output_token_ids) >= self.params.max_tokens:
                self.finish("length")
                break
        return appended

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One streamed increment of a request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token of ``new_token_ids`` when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """With the request's first output, when asked: None for the first prompt token, then one each."""


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: both outputs' tokens and log-probabilities,
    the later one's state (finished, reason, counts, stats, error)."""
    logprobs = None if first.logprobs is None and later.logprobs is None else \
        (first.logprobs or ()) + (later.logprobs or ())
    prompt_logprobs = first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs
    return dataclasses.replace(later, new_token_ids=first.new_token_ids + later.new_token_ids, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)


def needs_prefill(request: Request) -> bool:
    """No token yet, or the stages hold less than its context but the last token (it is new,
    preempted, or a stage lost its KV): its context goes through as chains, in chunks."""
    return not request.output_token_ids or request.num_computed_tokens < request.num_tokens - 1
