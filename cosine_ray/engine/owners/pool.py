"""The request pool: waiting and running requests, their lanes, and what a step changes.

::

    add ──▶ waiting ──admit──▶ running[lane] ──advance──▶ finished ──▶ released
             ▲  │                    │   │   ▲                                 ▲
             │  └──── abort ─────────┼───┴───┼──── abort ──────────────────────┘
             └──────── preempt ──────┘       └─ target lost: KV dropped → re-prefill
                                                (or error after max_restores)

The pool never touches a model or a drafter. Finished and aborted requests are queued for
release; the step frees their state on the target and the drafters (``take_released``).

Waiting requests are admitted fairly between tenants (``Request.tenant``: the API key's name,
then OpenAI's ``user`` within it): ``next_waiting`` offers the waiting request of the tenant
that runs the fewest requests, then of its user that runs the fewest, then the first in the
queue (preempted requests first, then by arrival). So tenants take the running slots in turn,
whatever one of them queued; requests of one tenant and user are first come first served.
``over_share`` names what the scheduler may preempt for a tenant that waits below its share.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from typing import Callable, Iterable, Sequence

from cosine_ray.engine.request import (NO_TENANT, REFUSED, Request, RequestOutput, RequestRefused, RequestStatus,
                                       SamplingParams, Tenant, merge_outputs)
from cosine_ray.engine.types import Verified

MIN_STEPS_BEFORE_FAIR_PREEMPTION = 4
"""Decoding steps a request runs after its admission before it may be preempted for another
tenant's share: each preemption costs a re-prefill (mostly prefix-cache hits), and a request
is never preempted again before it made progress."""


class RequestPool:
    def __init__(self, *, max_num_seqs: int, max_model_len: int, num_lanes: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), max_restores: int = 3,
                 clock: Callable[[], float], seed: int | None = None) -> None:
        """``seed``: the requests that give no sampling seed draw their keys, in the order they
        arrive, from a generator seeded with it (``EngineConfig.seed``); None: each a random one."""
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_lanes = num_lanes
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_restores = max_restores
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._released: list[Request] = []
        """Finished or aborted requests whose state on the target and drafters is still held."""
        self._completed: list[Request] = []
        """Requests that finished normally (stop, length) since the last ``take_completed``."""
        self._pending_outputs: list[RequestOutput] = []
        self._preempted: list[str] = []
        """Outputs produced outside a step (requests failed by a lost target)."""
        self._keys = None if seed is None else random.Random(seed)

    # ---- requests in ---------------------------------------------------------------------
    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot be served (before anything is queued)."""
        if not prompt_token_ids:
            raise RequestRefused("prompt must contain at least one token", "prompt")
        if any(not 0 <= int(t) < self.vocab_size for t in prompt_token_ids):
            raise RequestRefused(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRefused(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                                 f"({params.max_tokens}) exceeds the model length {self.max_model_len}",
                                 "max_tokens", "context")

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            tenant: Tenant = NO_TENANT) -> Request:
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check(prompt_token_ids, params)
        key = None if params.seed is not None or self._keys is None else self._keys.getrandbits(64)
        request = Request(request_id, [int(t) for t in prompt_token_ids], params, self.eos_token_ids,
                          arrival_time=self.clock(), seed=key, tenant=tenant)
        self.waiting.append(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its state on the target and drafters is freed at the next step."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.finish("abort")
                self._released.append(r)
                return True
        request = self.running.pop(request_id, None)
        if request is None:
            return False
        request.finish("abort")
        self._released.append(request)
        return True

    # ---- lanes and admission ---------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released or self._pending_outputs)

    def lane_has_work(self, lane: int) -> bool:
        can_admit = bool(self.waiting) and len(self.running) < self.max_num_seqs
        return (can_admit or bool(self._released) or bool(self._pending_outputs)
                or any(r.lane == lane for r in self.running.values()))

    def lane(self, lane: int | None) -> list[Request]:
        """Running requests of ``lane`` (None: all), in admission order."""
        return [r for r in self.running.values() if lane is None or r.lane == lane]

    def next_waiting(self) -> Request | None:
        """The waiting request to admit next (the module docstring's order), or None. A request
        preempted since the step began is not offered: the stages free its KV first."""
        if not self.waiting:
            return None
        tenants = Counter(r.tenant.name for r in self.running.values())
        users = Counter(r.tenant for r in self.running.values())
        best, best_key = None, None
        for position, r in enumerate(self.waiting):
            if r.request_id in self._preempted:
                continue
            key = (tenants[r.tenant.name], users[r.tenant], position)
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best

    def over_share(self, request: Request) -> list[Request]:
        """Running requests the scheduler may preempt so that ``request`` (waiting) gets in:
        those of the tenant that runs the most, when it runs at least two more than
        ``request``'s tenant (else, within ``request``'s tenant, of the user that runs at least
        two more than its user), that no step is working on and that ran
        ``MIN_STEPS_BEFORE_FAIR_PREEMPTION`` decoding steps since their admission. Latest
        arrival first. Preempting them evens the shares; it never swaps two equal ones."""
        running = list(self.running.values())
        mine = request.tenant
        tenants = Counter(r.tenant.name for r in running)
        top = max(tenants, key=tenants.__getitem__, default=None)
        if top is not None and top != mine.name and tenants[top] >= tenants[mine.name] + 2:
            group = [r for r in running if r.tenant.name == top]
        else:
            users = Counter(r.tenant for r in running if r.tenant.name == mine.name)
            top_user = max(users, key=users.__getitem__, default=None)
            if top_user is None or top_user == mine or users[top_user] < users[mine] + 2:
                return []
            group = [r for r in running if r.tenant == top_user]
        eligible = [r for r in group if not r.num_in_flight
                    and r.num_decode_steps - r.decode_steps_at_admission >= MIN_STEPS_BEFORE_FAIR_PREEMPTION]
        return sorted(eligible, key=lambda r: r.arrival_time, reverse=True)

    def admit(self, request: Request) -> None:
        """The waiting request ``next_waiting`` offers joins the running batch, in the least
        loaded lane (S stages get S equal micro-batches). It prefills when the scheduler says so."""
        assert request is self.next_waiting(), request.request_id  # nobody overtakes the fair order
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.decode_steps_at_admission = request.num_decode_steps
        if request.admitted_time is None:
            request.admitted_time = self.clock()
        loads = [0] * self.num_lanes
        for r in self.running.values():
            loads[r.lane] += 1
        request.lane = loads.index(min(loads))
        self.running[request.request_id] = request

    def preempt(self, request: Request) -> None:
        """Back to the front of the queue (its KV is freed by the scheduler): it resumes by
        recomputing its context, prompt and tokens so far, and goes on with the same text."""
        del self.running[request.request_id]
        request.status = RequestStatus.WAITING
        request.stats.num_preemptions += 1
        request.kv_epoch += 1
        self.waiting.appendleft(request)
        self._preempted.append(request.request_id)

    def take_preempted(self) -> list[str]:
        """Requests preempted since the last call: the stages free their KV before they resume."""
        ids, self._preempted = self._preempted, []
        return ids

    def requests(self) -> list[Request]:
        """Every request the pool holds: waiting, running, and finished but not released."""
        return [*self.waiting, *self.running.values(), *self._released]

    def is_live(self, request_id: str) -> bool:
        return request_id in self.running

    # ---- a step's results --------------------------------------------------------------------
    def advance(self, outcomes: Iterable[Verified]) -> list[RequestOutput]:
        """Append each request's verified tokens (stopping at EOS, stop tokens or max_tokens),
        stream them, and queue finished requests for release. Requests aborted while the step
        was in flight are skipped; outputs of requests failed meanwhile come first."""
        outputs, self._pending_outputs = self._pending_outputs, []
        for outcome in outcomes:
            request = self.running.get(outcome.request_id)
            if request is None:  # aborted (or failed) while this step was in flight
                continue
            if outcome.refusal is not None and not outcome.new_token_ids:  # its rules left no token
                outputs.append(self._end(request, REFUSED, outcome.refusal))
                continue
            first = not request.output_token_ids
            if outcome.prompt_logprobs is not None and first:
                if outcome.prompt_logprobs[:1] == (None,):  # from the prompt's start (again, if preempted)
                    request.prompt_logprobs.clear()
                request.prompt_logprobs.extend(outcome.prompt_logprobs)
            if not outcome.new_token_ids:  # a prompt chunk before the last: nothing to stream yet
                continue
            appended = request.append(list(outcome.new_token_ids))
            logprobs = None if outcome.logprobs is None else outcome.logprobs[:len(appended)]
            prompt_logprobs = (tuple(request.prompt_logprobs)
                               if first and request.params.prompt_logprobs is not None else None)
            outputs.append(RequestOutput(
                request.request_id, appended, request.is_finished, request.finish_reason,
                len(request.prompt_token_ids), len(request.output_token_ids), request.stats,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs))
            if request.is_finished:
                del self.running[request.request_id]
                self._released.append(request)
                self._completed.append(request)
            elif outcome.refusal is not None:  # no token after these: it ends alone (module ``verifier``)
                outputs[-1] = merge_outputs(outputs[-1], self._end(request, REFUSED, outcome.refusal))
        return outputs

    def refuse(self, request_id: str, message: str) -> None:
        """End a running request whose own rules leave no token (``REFUSED``); its output comes
        with the next ``advance``."""
        request = self.running.get(request_id)
        if request is not None:
            self._pending_outputs.append(self._end(request, REFUSED, message))

    def _end(self, request: Request, reason: str, message: str) -> RequestOutput:
        """Finish a running request with ``reason`` and ``message`` (an error, not a completion)."""
        request.finish(reason)
        del self.running[request.request_id]
        self._released.append(request)
        return RequestOutput(request.request_id, [], True, reason, len(request.prompt_token_ids),
                             len(request.output_token_ids), request.stats, error=message)

    @property
    def to_release(self) -> tuple[str, ...]:
        """Finished or aborted requests whose state is not freed yet."""
        return tuple(r.request_id for r in self._released)

    @property
    def num_to_release(self) -> int:
        return len(self._released)

    def take_completed(self) -> list[Request]:
        """Requests that finished with stop or length since the last call (drafters learn from them)."""
        done, self._completed = self._completed, []
        return done

    def take_released(self) -> list[Request]:
        """Finished or aborted requests whose state on the target and drafters is still held,
        except those a step of another lane still works on (``Request.num_in_flight``: its
        drafter or stage calls may not have been sent yet, and a call sent after the release
        would recreate the state it freed). Those stay queued for a later step."""
        ready = [r for r in self._released if not r.num_in_flight]
        self._released = [r for r in self._released if r.num_in_flight]
        return ready

    def target_lost(self, recovered: bool, reason: str) -> None:
        """The target dropped every request's KV (a stage restarted, or never came back):
        running requests re-prefill from prompt + committed tokens at their next step (nothing
        is streamed twice), or fail when it did not come back or they were restored too often."""
        for request in list(self.running.values()):
            request.num_restores += 1
            request.kv_epoch += 1
            if recovered and request.num_restores <= self.max_restores:
                continue
            self._pending_outputs.append(self._end(request, "error", f"target unavailable: {reason}"))
