"""A small causal LM as drafter (it must share the target's tokenizer).

Per request the drafter keeps its own KV cache of the tokens it has seen. On ``propose``
it rolls its cache back to the longest common prefix with the new context (its own
rejected drafts fall away), runs the missing context tokens as one chain, then drafts
greedily one token at a time, every request of the batch in the same forward. Each
draft token's confidence is the drafter's probability of it. The runner-up at the first
position is added as a one-token side branch when the budget allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             one_level_chains)
from cosine_ray.models.runner import StepRunner
from cosine_ray.models.llama import LlamaStage, StageBatch


@dataclass(frozen=True, slots=True)
class ModelDrafterConfig:
    min_confidence: float = 0.0
    """Stop a path when the drafter's probability of its next token is below this."""
    first_branch: bool = True
    """Add the runner-up first token as a side branch when the budget has room."""


def check_same_tokenizer(target_tokenizer: Any, drafter_tokenizer: Any, drafter_name: str) -> None:
    """Refuse a drafter whose tokenizer differs from the target's (its token ids would mean
    other strings, so its drafts could never be accepted)."""
    if target_tokenizer is None or drafter_tokenizer is None:
        return
    if target_tokenizer.get_vocab() != drafter_tokenizer.get_vocab():
        raise ValueError(f"drafter {drafter_name!r} does not share the target's tokenizer "
                         f"(vocabularies differ: {len(drafter_tokenizer.get_vocab())} vs "
                         f"{len(target_tokenizer.get_vocab())} tokens); use a model of the same family")


class ModelDrafter:
    def __init__(self, model: LlamaStage, config: ModelDrafterConfig = ModelDrafterConfig(),
                 name: str = "model", *, runner: str = "auto") -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("a model drafter needs the whole model (layers [0, num_layers))")
        self.model = model
        self.config = config
        self.name = name
        self.cache = model.new_kv_cache()
        self.runner = StepRunner(model, runner)
        """The target's runner: on CUDA its decode steps replay CUDA graphs (``models.runner``)."""
        self._seen: dict[str, list[int]] = {}

    def release(self, request_id: str) -> None:
        self.cache.free(request_id)
        self._seen.pop(request_id, None)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass  # the next context tells it everything it needs

    def _sync(self, inp: DraftInput) -> list[int]:
        """Roll the cache back to the common prefix; return the context tokens still to run."""
        rid, context = inp.request_id, list(inp.context_token_ids)
        seen = self._seen.get(rid)
        if seen is None:
            self.cache.allocate(rid)
            seen = self._seen[rid] = []
        common = 0
        limit = min(len(seen), len(context) - 1)  # always re-run at least the root
        while common < limit and seen[common] == context[common]:
            common += 1
        self.cache.truncate(rid, common)
        del seen[common:]
        return context[common:]

    @torch.inference_mode()
    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        """One batched forward per prefix slot: the cache rolls back to the longest common
        prefix of what it holds and ``context ⊕ prefix`` (the fused prefix and a drafter's
        own branch differ in their last token only, so each costs one or two tokens)."""
        out: list[list[Candidates]] = [[[] for _ in q.prefixes] for q in queries]
        for slot in range(max((len(q.prefixes) for q in queries), default=0)):
            live = [(qi, q) for qi, q in enumerate(queries) if slot < len(q.prefixes) and q.k > 0]
            if not live:
                continue
            rids = [q.request_id for _, q in live]
            chains = [self._sync(DraftInput(q.request_id, tuple(q.context_token_ids) + tuple(q.prefixes[slot]), 1))
                      for _, q in live]
            starts = [self.cache.committed_length(rid) for rid in rids]
            logits = self.runner.forward(StageBatch.from_chains(rids, chains, starts), self.cache)
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.topk(max(q.k for _, q in live), dim=-1)
            for row, ((qi, q), chain) in enumerate(zip(live, chains)):
                self.cache.commit(q.request_id)
                self._seen[q.request_id].extend(chain)
                out[qi][slot] = [(int(t), float(c)) for t, c in
                                 zip(top.indices[row, :q.k].tolist(), top.values[row, :q.k].tolist())]
        return out

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return one_level_chains(self, queries)

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        active = [inp for inp in inputs if inp.max_draft_tokens > 0]
        paths: dict[str, list[int]] = {inp.request_id: [] for inp in active}
        confs: dict[str, list[float]] = {inp.request_id: [] for inp in active}
        branch: dict[str, tuple[int, float]] = {}
        pending = {inp.request_id: self._sync(inp) for inp in active}
        budgets = {inp.request_id: inp.max_draft_tokens for inp in active}
        live = [inp.request_id for inp in active]
        first = True
        while live:
            chains = [pending[rid] for rid in live]
            starts = [self.cache.committed_length(rid) for rid in live]
            batch = StageBatch.from_chains(live, chains, starts)
            logits = self.runner.forward(batch, self.cache)  # [len(live), vocab]
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.topk(2, dim=-1)
            still = []
            for row, rid in enumerate(live):
                self.cache.commit(rid)
                self._seen[rid].extend(pending[rid])
                token, conf = int(top.indices[row, 0]), float(top.values[row, 0])
                if first and self.config.first_branch:
                    branch[rid] = (int(top.indices[row, 1]), float(top.values[row, 1]))
                if conf < self.config.min_confidence:
                    continue
                paths[rid].append(token)
                confs[rid].append(conf)
                pending[rid] = [token]
                if len(paths[rid]) < budgets[rid]:
                    still.append(rid)
            live = still
            first = False
        out = []
        for inp in inputs:
            rid = inp.request_id
            if rid not in paths or not paths[rid]:
                out.append(DraftProposal.empty(rid, self.name))
                continue
            result_paths, result_confs = [paths[rid]], [confs[rid]]
            if rid in branch and len(paths[rid]) < budgets[rid]:
                result_paths.append([branch[rid][0]])
                result_confs.append([branch[rid][1]])
            out.append(DraftProposal(rid, result_paths, result_confs, self.name))
        return out
