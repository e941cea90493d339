"""What one step hands from owner to owner: the step's boundary types.

``StepBatch`` (schedule → route, draft, verify), ``Route`` (route → draft), ``Drafted`` and
``Drafts`` (draft → verify, learn), ``Verified`` and ``VerifiedBatch`` (verify → commit, learn,
advance). They are plain data, so the owners (``engine.owners``) depend on this module and not
on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.tree_selection import SelectedTree, TreePrice
from cosine_ray.algo.verify import VerifyResult
from cosine_ray.engine.request import Request
from cosine_ray.engine.worker.scoring import KVCommit

PROBE_EVERY = 8
"""A request priced at γ = 0 still drafts and verifies one node every this many decoding
steps, so calibration keeps measuring its drafters and speculation can come back."""


@dataclass(slots=True)
class StepBatch:
    """What one step runs (one lane's micro-batch)."""

    requests: list[Request]
    """Scheduled requests, running ones first, then the ones admitted now."""
    budgets: dict[str, int] = field(default_factory=dict)
    """Draft-token cap γ_i of each decoding request (0 = no drafting); prefills are absent."""
    price: TreePrice | None = None
    """The LP's price for TreeSelection; None for the fixed-cut and fixed-γ policies."""
    num_steps: dict[str, int] = field(default_factory=dict)
    """Steps each decoding request has been scheduled for, this one included."""
    decision_s: float = 0.0
    """Time this scheduling decision took (the LP solve included)."""
    level: int | None = None
    """The guard's speculation level this step runs at (``algo.guard``); None: no guard."""
    started_at: float = 0.0
    """Clock at the start of the decision (the step's wall time is measured from here)."""
    weights: dict[str, float] = field(default_factory=dict)
    """While the pool drains: what an accepted token of each decoding request is worth, in
    [0, 1] (``BatchScheduler._drain_weights``); empty otherwise (every request 1)."""
    chunks: dict[str, int] = field(default_factory=dict)
    """Requests that prefill this step → how many of their context tokens (a whole prompt, or a
    chunk of it within the step's token budget); decoding requests are in ``budgets``."""
    epochs: dict[str, int] = field(default_factory=dict)
    """Each request's ``kv_epoch`` when scheduled: one whose KV was dropped since sits out."""
    twins: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Decoding requests that draft from an identical request ahead of them (``engine.modes.twins``):
    its tokens beyond theirs, at most their budget. Not routed to the drafters; verified whole."""
    forced: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Decoding requests whose grammar forces their next tokens (jump-forward,
    ``engine.owners.constraints.forced_tokens``): those tokens, counted in their budget. The
    first chain of their tree, verified whole at any level or price; the drafters draft after it."""

    @property
    def prefills(self) -> list[Request]:
        return [r for r in self.requests if r.request_id in self.chunks]

    @property
    def decodes(self) -> list[Request]:
        return [r for r in self.requests if r.request_id in self.budgets]

    @classmethod
    def make_empty(cls) -> "StepBatch":
        return cls([])


@dataclass(frozen=True, slots=True)
class Route:
    drafters: tuple[str, ...]
    """Drafters of this request's step: the routed ones best-scoring first, then the shared ones."""
    mode: str
    """eq. 3's mode for the routed ones: explore | exploit | random."""
    num_shared: int = 0
    """How many of ``drafters`` (at the end) are shared drafters."""

    def mode_of(self, drafter: str) -> str:
        return "shared" if drafter in self.drafters[len(self.drafters) - self.num_shared:] else self.mode


Answers = dict[str, list[tuple[int | None, float]]]
"""Per drafter, per depth: its token after the fused prefix and raw confidence (eq. 1-2)."""


@dataclass(slots=True)
class Drafted:
    paths: list[FusedPath] = field(default_factory=list)
    answers: Answers = field(default_factory=dict)
    trunk: tuple[int, ...] = ()
    route: Route | None = None
    """The route that drafted it (the learner scores its drafters' answers, eq. 1-2)."""


@dataclass(slots=True)
class DraftTree:
    """One request's speculation for this step."""

    selected: SelectedTree
    route: Route | None = None
    answers: Answers = field(default_factory=dict)
    trunk: tuple[int, ...] = ()
    """The fused trunk's tokens (fusion mode), to count fusion picks."""
    full_gains: tuple[float, ...] = (0.0,)
    """Expected-gain curve of everything drafted, before γ_i cut it (predicts the next step)."""

    @property
    def tree(self) -> TokenTree:
        return self.selected.tree


@dataclass(slots=True)
class DraftingStats:
    """One step's drafting as it happened (the learner puts it into ``StepStats``)."""

    failures: list[str] = field(default_factory=list)
    """Drafter of each dropped call or malformed answer (error, deadline, garbage)."""
    rounds: int = 0
    """Fusion rounds (trunk positions decided)."""
    calling_rounds: int = 0
    """Rounds that waited for at least one drafter: the step's drafting latency in round trips."""
    calls: int = 0
    """Drafter calls made (one per drafter per round that needed it)."""
    num_drafted_nodes: int = 0
    """Draft nodes of the full trees, before TreeSelection cut them to γ_i."""
    selection_s: float = 0.0
    """Time TreeSelection took (part of the step's scheduling decision)."""

    def failed(self, name: str) -> None:
        self.failures.append(name)


@dataclass(slots=True)
class Drafts:
    """The step's trees (one per decoding request) and how drafting went."""

    trees: dict[str, DraftTree]
    stats: DraftingStats

    @classmethod
    def make_empty(cls) -> "Drafts":
        return cls({}, DraftingStats())


@dataclass(frozen=True, slots=True)
class Verified:
    """What one verify step decided for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    """Accepted draft tokens then the bonus token, or a prefill's first token."""
    keep: tuple[int, ...]
    """Slots of this step's new tokens whose KV is kept (root + accepted path, or the whole
    prefill chain): the KV commit."""
    result: VerifyResult | None = None
    """The tree verification (None for a prefill)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """The target's log-probability of each new token, when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """A prompt chunk's: those of the prompt tokens after each of its tokens (None first)."""
    refusal: str | None = None
    """Why the request ends here, alone: its own rules mask every token of the row its next
    token comes from (``engine.owners.verifier.NoTokenLeft``); no token is new then."""

    @property
    def is_prefill(self) -> bool:
        return self.result is None


@dataclass(slots=True)
class VerifiedBatch:
    outcomes: list[Verified] = field(default_factory=list)
    context_lens: tuple[int, ...] = ()
    """Committed tokens of each scored item before this step (the latency model's l_i)."""
    num_new_tokens: tuple[int, ...] = ()
    """Tokens each scored item sent (n_i)."""
    verify_s: float = 0.0
    """Wall time of the target call."""
    verifier_idle_fraction: float = 0.0
    """Share of wall time since the last step that no score call was in flight (all lanes)."""
    lost: bool = False
    """The target lost this step's KV (a stage restarted): nothing was verified."""

    @property
    def commits(self) -> list[KVCommit]:
        return [KVCommit(o.request_id, o.keep) for o in self.outcomes]
