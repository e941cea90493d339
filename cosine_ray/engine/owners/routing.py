"""Routing each step's decoding requests to drafters (CoSine eq. 1-3, ``algo.routing``).

A request's domain is classified once, on arrival (``algo.domains``), and with whether it
carries a grammar or a prediction, how much its prompt repeats itself and its tenant it makes
the request's kind (``algo.request_kind``), whose prior it starts from (its domain's until its
kind has learned); from then on its routing vector learns from its own verify steps (the
learner feeds eq. 1-2 back through ``update``, into its kind's and domain's priors too). Each step every decoding request with a draft budget gets
its k routed drafters (best-scoring first, the tie order fusion uses) plus the *shared*
drafters, which join every request (``SpeculationConfig.shared_drafters``: the context n-gram
drafter knows the request's own text better than any domain expert). k is the adaptive
participation (``algo.adaptive.ParticipationController``) or fixed. A request that carries a
prediction (OpenAI's Predicted Outputs) also gets the *prediction* drafter, as a shared one;
it is told the prediction when the request starts, and requests without one never call it.

The ablations are chosen once here: ``routing="random"`` draws the k experts uniformly;
``fusion="single"`` routes exactly one drafter (shared ones compete for that slot too).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.algo.domains import DomainClassifier
from cosine_ray.algo.request_kind import RequestKind
from cosine_ray.algo.routing import ExpertiseRouting, RoutingConfig
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.prediction import PredictionDrafter
from cosine_ray.engine.request import Request, SamplingParams
from cosine_ray.engine.types import Route, StepBatch


class DraftRouting:
    def __init__(self, config: EngineConfig, drafter_names: Sequence[str], *,
                 domain_classifier: DomainClassifier | None = None,
                 participation: ParticipationController | None = None, seed: int | None = 0,
                 prediction: PredictionDrafter | None = None) -> None:
        spec, exp = config.speculation, config.experiments
        single = exp.fusion == "single"
        shared = set() if single else set(spec.shared_drafters)
        self.prediction = prediction
        """The drafter of requests with a prediction (``engine.drafters.prediction``); None: none
        in the pool (speculation off)."""
        own = {prediction.name} if prediction is not None else set()
        self.shared = tuple(n for n in drafter_names if n in shared and n not in own)
        self.max_prediction_tokens = config.scheduler.max_model_len
        """Longest prediction a request may carry (its index costs memory and time per token)."""
        self.expertise = ExpertiseRouting(
            [n for n in drafter_names if n not in shared and n not in own],
            RoutingConfig(drafters_per_request=spec.drafters_per_request,
                          mode="random" if exp.routing == "random" else "expertise"), seed=seed)
        self.domain_classifier = domain_classifier
        self.participation = participation
        """Adaptive k; None: k is fixed (1 with ``fusion="single"``)."""
        self._fixed_k = 1 if single else spec.drafters_per_request
        self._has_drafters = bool(drafter_names)

    @property
    def drafters_per_request(self) -> int:
        return self.participation.current if self.participation is not None else self._fixed_k

    # ---- request lifecycle --------------------------------------------------------------
    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """ValueError if the request's prediction cannot be drafted from."""
        prediction = params.prediction
        if len(prediction) > self.max_prediction_tokens:
            raise ValueError(f"prediction has {len(prediction)} tokens; at most {self.max_prediction_tokens} "
                             f"(the model's context)")
        if prediction and max(prediction) >= vocab_size:
            raise ValueError(f"prediction token ids must be in [0, {vocab_size})")

    def start(self, request: Request) -> None:
        """Classify the prompt's domain, start its routing vector from its kind's prior, and
        tell the prediction drafter what the request predicts."""
        if self.prediction is not None and request.params.prediction:
            self.prediction.expect(request.request_id, len(request.prompt_token_ids), request.params.prediction)
        if self.domain_classifier is not None:
            request.domain = self.domain_classifier.classify(request.prompt_token_ids)[0]
        request.stats.domain = request.domain
        kinds = self.kind_of(request).prior_keys() if self._has_drafters else ()  # no prompt scan for nothing
        request.routing = self.expertise.start(request.request_id, request.domain, kinds)

    @staticmethod
    def kind_of(request: Request) -> RequestKind:
        """The request's kind: its domain, grammar, prediction, repetition and tenant."""
        return RequestKind.of(request.domain, request.prompt_token_ids, grammar=request.params.structured is not None,
                              prediction=bool(request.params.prediction), tenant=request.tenant.name)

    def priors(self, requests: Sequence[Request]) -> dict[str, dict[str, float]]:
        """The priors of these requests' domains (for the metrics, as requests finish)."""
        return {r.domain: self.expertise.prior(r.routing.domain) for r in requests if r.routing is not None}

    def update(self, request: Request, scores: Mapping[str, float], accepted_len: int | None) -> None:
        """Fold one verify step's eq. 2 scores into M_r and the domain priors (the learner)."""
        self.expertise.update(request.routing, scores, accepted_len)

    # ---- eq. 3 ------------------------------------------------------------------------------
    def route(self, batch: StepBatch) -> dict[str, Route]:
        """Drafters for every decoding request with a draft budget beyond its forced tokens
        (others draft nothing, and a twin's follower drafts from its leader, ``engine.modes.twins``)."""
        if not self._has_drafters:
            return {}
        drafting = [r for r in batch.decodes if batch.budgets[r.request_id] > len(batch.forced.get(r.request_id, ()))
                    and r.request_id not in batch.twins]
        choices = self.expertise.choose([r.routing for r in drafting], k=self.drafters_per_request)
        routes = {}
        for r in drafting:
            choice = choices[r.request_id]
            scores = self.expertise.scores(r.routing)
            routed = tuple(sorted(choice.drafters, key=lambda n: -scores.get(n, 0.0)))
            shared = self.shared + self._prediction_of(r)
            route = Route(routed + shared, choice.mode, len(shared))
            routes[r.request_id] = route
            r.stats.num_routed_steps += 1
            for name in route.drafters:
                r.stats.routed_to[name] = r.stats.routed_to.get(name, 0) + 1
        return routes

    def _prediction_of(self, request: Request) -> tuple[str, ...]:
        """The prediction drafter, for a request that carries a prediction."""
        return (self.prediction.name,) if self.prediction is not None and request.params.prediction else ()
