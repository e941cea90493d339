"""A feature head as drafter (EAGLE): it drafts from the target's own features.

Per request the head keeps its layer's KV over the committed positions it has read, one row
per position j < root with input ``[E(x_{j+1}); f_j]`` (``head_model``); the features f_j
come from the last stage through a ``FeatureStore`` (``engine.worker.features``). A step first
reads the features of what the target committed since the last step (a rejected draft's rows
fall away: only the committed prefix is kept), then drafts in feature space: a draft node's
row reads its token and its parent's output g, attends to the committed rows and its own
ancestors, and its output scores its children through the target's LM head restricted to the
head's vocabulary. ``propose`` grows a tree (EAGLE-2: the ``width`` most likely nodes of each
depth are expanded, the budget's most likely nodes are kept); ``continue_chains`` serves
confidence fusion, every path computed once per step (a per-step cache keyed by the path).
A request with a missing feature (none recorded, or a multi-process engine) gets no draft.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from cosine_ray.engine.drafters.base import Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal
from cosine_ray.engine.drafters.models.head_model import FeatureHead, HeadConfig
from cosine_ray.engine.worker.features import FeatureStore

HEAD_METADATA = "cosine_ray_drafter.json"


@dataclass(frozen=True, slots=True)
class FeatureHeadConfig:
    width: int = 3
    """Nodes of a depth expanded, and children asked of each (EAGLE-2's top-k)."""
    max_depth: int = 6
    """Deepest draft level ``propose`` grows."""


@dataclass(slots=True)
class _Row:
    k: torch.Tensor  # [kv_heads, head_dim]
    v: torch.Tensor
    g: torch.Tensor  # [hidden], the row's output ≈ the next position's feature


@dataclass(slots=True)
class _State:
    seen: list[int] = field(default_factory=list)
    """Context tokens x_0..x_m whose rows ``start``..m-1 are in ``k``/``v``."""
    start: int = 0
    """Position of the first row (positions before it had no feature: a prefix-cache hit)."""
    k: torch.Tensor | None = None  # [m, kv_heads, head_dim]
    v: torch.Tensor | None = None
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    root_g: torch.Tensor | None = None
    """Output of row m - 1 (drafts depth 1)."""
    draft: dict[tuple[int, ...], _Row] = field(default_factory=dict)
    """This step's draft rows, keyed by their path after the root."""


class FeatureHeadDrafter:
    def __init__(self, head: FeatureHead, embedding: torch.Tensor, lm_head: torch.Tensor, vocab: torch.Tensor,
                 store: FeatureStore, config: FeatureHeadConfig = FeatureHeadConfig(), name: str = "head") -> None:
        """embedding  # [target vocab, hidden]; lm_head  # [target vocab, hidden]; vocab  # [V] target ids."""
        self.head = head.eval()
        self.embedding = embedding
        self.vocab = vocab.long()
        self.head_rows = lm_head[self.vocab].contiguous()  # [V, hidden]
        self.store = store
        self.config = config
        self.name = name
        self._states: dict[str, _State] = {}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.store.drop(request_id)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass  # the next context and the store's records say what was accepted

    # ---- committed rows --------------------------------------------------------------------
    def _sync(self, request_id: str, context: Sequence[int]) -> _State | None:
        """Bring the request's rows up to the root (rows for positions ``start``..len(context) - 2);
        None when the feature of the position before the root is missing. Rows start after the
        last position without a feature: a prompt prefix the target read from the prefix cache
        was never computed, so it has none, and the head attends to the rows after it."""
        state = self._states.setdefault(request_id, _State())
        state.features.update(self.store.committed(request_id, context))
        t = len(context) - 1
        rows = 0 if state.k is None else state.k.shape[0]
        if state.start + rows == t and state.root_g is not None and state.seen == list(context):
            return state  # this step's rows (and its draft cache) are current
        state.draft, state.root_g = {}, None
        if t < 1:
            return None
        common = 0
        limit = min(len(state.seen), len(context))
        while common < limit and state.seen[common] == context[common]:
            common += 1
        # row j reads x_{j+1}: valid while it matches
        keep = max(0, min(common - 1 - state.start, rows, t - 1 - state.start))
        missing = [j for j in range(state.start + keep, t) if j not in state.features]
        if missing:
            if missing[-1] == t - 1:
                return None
            state.start, keep = missing[-1] + 1, 0
        if state.k is not None:
            state.k, state.v = state.k[:keep], state.v[:keep]
        first = state.start + keep
        new = torch.arange(first, t)
        emb = self.embedding[torch.tensor(list(context[first + 1:t + 1]))]
        feats = torch.stack([state.features[j] for j in range(first, t)])

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = k if state.k is None or keep == 0 else torch.cat([state.k, k])
            values = v if state.v is None or keep == 0 else torch.cat([state.v, v])
            state.k, state.v = keys, values
            mask = torch.ones(len(new), keep + len(new), dtype=torch.bool).tril(keep)
            return _sdpa(q, keys, values, mask)

        with torch.inference_mode():
            g = self.head(emb, feats, new, attend)
        state.seen = list(context)
        state.root_g = g[-1]
        for j in [j for j in state.features if j < t - 1]:
            del state.features[j]  # rows hold them now; keep the last for a re-sync after a rollback
        return state

    # ---- draft rows ------------------------------------------------------------------------
    def _expand(self, work: Sequence[tuple[_State, tuple[int, ...]]]) -> None:
        """Compute the rows of these paths (their parents' rows exist), one batched forward."""
        if not work:
            return
        emb = self.embedding[torch.tensor([path[-1] for _, path in work])]
        feats = torch.stack([state.root_g if len(path) == 1 else state.draft[path[:-1]].g for state, path in work])
        positions = torch.tensor([len(state.seen) - 1 + len(path) - 1 for state, path in work])

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = []
            for i, (state, path) in enumerate(work):
                anc = [state.draft[path[:d]] for d in range(1, len(path))]
                keys = torch.cat([state.k] + [r.k[None] for r in anc] + [k[i:i + 1]])
                values = torch.cat([state.v] + [r.v[None] for r in anc] + [v[i:i + 1]])
                out.append(_sdpa(q[i:i + 1], keys, values, None))
                work_rows.append((k[i], v[i]))
            return torch.cat(out)

        work_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode():
            g = self.head(emb, feats, positions, attend)
        for (state, path), (k, v), gi in zip(work, work_rows, g):
            state.draft[path] = _Row(k, v, gi)

    def _ensure(self, work: Sequence[tuple[_State, tuple[int, ...]]]) -> None:
        """Rows for these paths and all their ancestors, level by level."""
        todo = {(id(s), p[:d]): (s, p[:d]) for s, p in work for d in range(1, len(p) + 1) if p[:d] not in s.draft}
        for depth in sorted({len(p) for _, p in todo.values()}):
            self._expand([(s, p) for s, p in todo.values() if len(p) == depth])

    def _top(self, gs: torch.Tensor, k: int) -> list[Candidates]:
        """gs  # [rows, hidden] -> per row the k most likely tokens (target ids) and probabilities."""
        probs = torch.softmax((gs @ self.head_rows.T).float(), dim=-1)  # [rows, V]
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        ids = self.vocab[top.indices]
        return [list(zip(i.tolist(), p.tolist())) for i, p in zip(ids, top.values)]

    def _g(self, state: _State, path: tuple[int, ...]) -> torch.Tensor:
        return state.root_g if not path else state.draft[path].g

    # ---- the drafter protocol --------------------------------------------------------------
    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        out: list[list[list[Candidates]]] = [[[] for _ in q.prefixes] for q in queries]
        chains = []
        for qi, q in enumerate(queries):
            state = self._sync(q.request_id, q.context_token_ids)
            if state is not None and q.k > 0:
                chains += [(qi, si, state, tuple(p)) for si, p in enumerate(q.prefixes)]
        self._ensure([(s, p) for _, _, s, p in chains if p])
        for _ in range(max((queries[qi].depth for qi, *_ in chains), default=0)):
            if not chains:
                break
            gs = torch.stack([self._g(s, p) for _, _, s, p in chains])
            answers = self._top(gs, max(queries[qi].k for qi, *_ in chains))
            grow = []
            for (qi, si, s, p), cands in zip(chains, answers):
                out[qi][si].append(cands[:queries[qi].k])
                if len(out[qi][si]) < queries[qi].depth:
                    grow.append((qi, si, s, p + (cands[0][0],)))
            self._expand([(s, p) for _, _, s, p in grow if p not in s.draft])
            chains = grow
        return [[levels or [[]] for levels in per_query] for per_query in out]

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        one = [ContinueQuery(q.request_id, q.context_token_ids, q.prefixes, q.k, 1) for q in queries]
        return [[levels[0] if levels else [] for levels in per_query] for per_query in self.continue_chains(one)]

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        width, trees = self.config.width, {}
        for inp in inputs:
            state = self._sync(inp.request_id, inp.context_token_ids) if inp.max_draft_tokens > 0 else None
            if state is not None:
                trees[inp.request_id] = (state, {(): 1.0}, {}, [()])  # cum prob, own prob, frontier
        for depth in range(1, self.config.max_depth + 1):
            live = [(rid, s, p) for rid, (s, _, _, frontier) in trees.items() for p in frontier]
            if not live:
                break
            self._ensure([(s, p) for _, s, p in live if p])
            answers = self._top(torch.stack([self._g(s, p) for _, s, p in live]), width)
            fresh: dict[str, list[tuple[int, ...]]] = {}
            for (rid, s, p), cands in zip(live, answers):
                cum, own = trees[rid][1], trees[rid][2]
                for token, prob in cands:
                    child = p + (token,)
                    cum[child], own[child] = cum[p] * prob, prob
                    fresh.setdefault(rid, []).append(child)
            for rid, (s, cum, own, _) in trees.items():
                best = sorted(fresh.get(rid, []), key=lambda c: -cum[c])[:width]
                trees[rid] = (s, cum, own, best if depth < self.config.max_depth else [])
        out = []
        for inp in inputs:
            if inp.request_id not in trees:
                out.append(DraftProposal.empty(inp.request_id, self.name))
                continue
            _, cum, own, _ = trees[inp.request_id]
            leaves = _within_budget(sorted((p for p in cum if p), key=lambda p: (-cum[p], len(p))),
                                    inp.max_draft_tokens)
            leaves.sort(key=lambda p: -cum[p])
            out.append(DraftProposal(inp.request_id, [list(p) for p in leaves],
                                     [[own[p[:d]] for d in range(1, len(p) + 1)] for p in leaves], self.name))
        return out

    def state_size(self) -> dict[str, int]:
        return {"pending_feature_requests": self.store.num_requests()}


def _within_budget(ranked: Sequence[tuple[int, ...]], budget: int) -> list[tuple[int, ...]]:
    """The leaves of the most likely nodes (``ranked``: parents before children) whose root
    paths total at most ``budget`` tokens (a proposal counts every path's tokens)."""
    leaves: set[tuple[int, ...]] = set()
    kept: set[tuple[int, ...]] = set()
    cost = 0
    for node in ranked:
        parent = node[:-1]
        if parent and parent not in kept:
            continue
        extra = 1 if (parent in leaves or not parent) else len(node)
        if cost + extra > budget:
            continue
        cost += extra
        kept.add(node)
        leaves.discard(parent)
        leaves.add(node)
    return list(leaves)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q  # [n, heads, hd]; k, v  # [L, kv_heads, hd]; mask [n, L] bool or None -> [n, heads, hd]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)


# ---- files -----------------------------------------------------------------------------------

def save_feature_head(head: FeatureHead, vocab: Sequence[int], folder: str | Path, metadata: dict) -> Path:
    """``head.safetensors`` (fp16) + ``config.json`` + the metadata file (target, data, vocabulary)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items()},
              str(folder / "head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "cosine_ray_feature_head",
                                                    **head.config.to_dict()}, indent=1))
    (folder / HEAD_METADATA).write_text(json.dumps({**metadata, "kind": "head", "vocabulary": list(vocab)}))
    return folder


def read_metadata(folder: str | Path) -> dict:
    path = Path(folder) / HEAD_METADATA
    if not path.is_file():
        raise ValueError(f"{folder} has no {HEAD_METADATA}; is it a drafter written by `cosine-ray distill`?")
    return json.loads(path.read_text())


def load_feature_head(folder: str | Path, target_state: dict[str, torch.Tensor], store: FeatureStore,
                      config: FeatureHeadConfig = FeatureHeadConfig(), name: str = "head") -> FeatureHeadDrafter:
    """A saved head over the target's embedding and LM head (fp32 on CPU)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    meta = read_metadata(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("model_type", None)
    head = FeatureHead(HeadConfig(**raw))
    head.load_state_dict({k: v.float() for k, v in load_file(str(folder / "head.safetensors")).items()})
    embedding = target_state["model.embed_tokens.weight"].float()
    lm_head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"]).float()
    if embedding.shape[1] != head.config.hidden_size:
        raise ValueError(f"feature head {folder} has hidden size {head.config.hidden_size}, the target "
                         f"{embedding.shape[1]}: it was trained for another target")
    vocab = torch.tensor(meta["vocabulary"], dtype=torch.long)
    if int(vocab.max()) >= embedding.shape[0]:
        raise ValueError(f"feature head {folder}: its vocabulary has ids past the target's {embedding.shape[0]}")
    return FeatureHeadDrafter(head, embedding, lm_head, vocab, store, config, name)
