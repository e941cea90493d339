"""The target's features for a feature head: the last stage keeps them, the head reads them.

A *feature* is the target's final-norm hidden state at a position (its LM head's input). A
feature head (``engine.drafters.models.feature_head``) drafts from the features of the committed
positions. ``FeatureStage`` is the last stage with one difference: besides the logits of the
rows that want them, it hands the features of *every* row of its batch (prompt chunks and
tree nodes) to a ``FeatureStore``, per request, as raw records. The store does not know which
tree nodes the target accepted; its reader does, from the request's context (the committed
tokens after a tree's root are its accepted path), and ``committed`` resolves them.
Features cost one RMSNorm over the batch's rows and never touch the logits, so the text is
unchanged; a missing or late feature only makes the head draft nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from cosine_ray.models.llama import LlamaStage, StageBatch, _rms_norm


@dataclass(frozen=True, slots=True)
class FeatureRecord:
    """One forward's rows of one request."""

    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    ancestors: torch.Tensor | None
    """[n, n] bool ancestor mask of a tree (row i: the nodes on i's path, itself included);
    None for a causal chain (a prompt chunk: every row is committed)."""
    features: torch.Tensor  # [n, hidden]


class FeatureStore:
    """Pending feature records per request, and each request's resolved committed features."""

    def __init__(self, max_pending: int = 256) -> None:
        self.max_pending = max_pending
        """Records kept per request before the oldest are dropped (a request the head never
        drafts for would otherwise grow a list; the head then drafts nothing for it)."""
        self._pending: dict[str, list[FeatureRecord]] = {}

    def record(self, request_id: str, record: FeatureRecord) -> None:
        pending = self._pending.setdefault(request_id, [])
        pending.append(record)
        if len(pending) > self.max_pending:
            del pending[0]

    def record_batch(self, batch: StageBatch, features: torch.Tensor) -> None:
        """features  # [batch.num_tokens, hidden], rows in the batch's request order."""
        offset = 0
        tokens = batch.token_ids.tolist() if batch.token_ids is not None else None
        positions = batch.positions.tolist()
        for rid, n, mask in zip(batch.request_ids, batch.num_new_tokens, batch.tree_masks):
            if tokens is not None and not batch.extend:
                self.record(rid, FeatureRecord(tuple(positions[offset:offset + n]), tuple(tokens[offset:offset + n]),
                                               None if mask is None else mask.cpu(),
                                               features[offset:offset + n].detach().to("cpu", torch.float32)))
            offset += n

    def committed(self, request_id: str, context: Sequence[int]) -> dict[int, torch.Tensor]:
        """position → feature [hidden] for the committed positions (below ``len(context)``)
        the pending records cover, resolving each tree to its accepted path; consumes them."""
        out: dict[int, torch.Tensor] = {}
        for rec in self._pending.pop(request_id, []):
            if rec.ancestors is None:
                for i, p in enumerate(rec.positions):
                    if p < len(context) and context[p] == rec.token_ids[i]:
                        out[p] = rec.features[i]
                continue
            node = 0  # the root is committed (its token is context[positions[0]])
            if rec.positions[0] >= len(context) or context[rec.positions[0]] != rec.token_ids[0]:
                continue
            while True:
                out[rec.positions[node]] = rec.features[node]
                nxt = rec.positions[node] + 1
                if nxt >= len(context):
                    break
                children = [j for j in range(len(rec.token_ids)) if rec.positions[j] == nxt
                            and bool(rec.ancestors[j, node]) and rec.token_ids[j] == context[nxt]]
                if not children:
                    break
                node = children[0]
        return out

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def num_requests(self) -> int:
        return len(self._pending)


class FeatureStage(LlamaStage):
    """The last stage, handing every row's feature to ``store`` (see the module docstring)."""

    store: FeatureStore

    @classmethod
    def wrap(cls, stage: LlamaStage, store: FeatureStore) -> "FeatureStage":
        """This stage's weights as a ``FeatureStage`` (no copy)."""
        if not stage.is_last:
            raise ValueError("only the last stage has features")
        out = cls.__new__(cls)
        out.__dict__.update(stage.__dict__)
        out.store = store
        out._rows = None
        return out

    def forward(self, batch: StageBatch, kv_cache, hidden: torch.Tensor | None = None) -> torch.Tensor:
        self._rows = batch.logit_indices
        self._batch = batch
        try:
            return super().forward(dataclasses.replace(batch, logit_indices=None), kv_cache, hidden)
        finally:
            self._rows = self._batch = None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x  # [rows, hidden] -> fp32 logits of the wanted rows; every row's feature to the store."""
        h = _rms_norm(x, self.norm_weight, self.config.rms_norm_eps)
        if self._batch is not None:
            self.store.record_batch(self._batch, h)
            if self._rows is not None:
                h = h[self._rows.to(h.device)]
        return self.lm_head(h).float()
