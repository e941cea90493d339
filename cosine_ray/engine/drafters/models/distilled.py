"""A domain drafter distilled from the target (``cosine-ray distill``): a small causal LM over a
frequency-ranked sub-vocabulary of the target's tokenizer.

The checkpoint is a Hugging Face Llama directory whose vocabulary is *compact*: id 0 stands for
every target token outside the domain's vocabulary, id i ≥ 1 for target token ``vocabulary[i -
1]`` (the metadata file, with the target, domain and data). Its embedding and LM head are
therefore small (FR-Spec: the LM head is most of a small drafter's cost); a target token outside
the vocabulary is read as id 0 and never proposed, which costs acceptance, never text.

Per request the drafter keeps its KV cache of the context it has computed *exactly* (every layer
in order). Each call rolls the cache back to the longest common prefix with the new context and
runs the rest as one chain, whose last row drafts the first token; later draft tokens run one
forward a token, all requests together. With ``layer_parallel`` (EasySpec's fuzzy speculation)
those later forwards feed every layer's attention the hidden state entering the first layer,
the MLPs still in order; their keys and values are inexact, so they are dropped after drafting
and the next call recomputes the accepted tokens exactly with the bonus token (EasySpec's bonus
calibration). The target verifies every token either way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             one_level_chains)
from cosine_ray.models.llama import LlamaStage, StageBatch

DRAFTER_METADATA = "cosine_ray_drafter.json"


@dataclass(frozen=True, slots=True)
class DistilledConfig:
    layer_parallel: bool = False
    """EasySpec: draft tokens after the first run every layer's attention on one stale input."""
    first_branch: bool = True
    """Add the runner-up first token as a side branch when the budget has room."""


class LayerParallelStage(LlamaStage):
    """A whole small model whose ``fuzzy`` forwards run EasySpec's layer-parallel attention:
    every layer's q/k/v come from the hidden state entering layer 0 (one matmul for all
    layers, the RMSNorm weights folded in), attention per layer, then the o-projections and
    MLPs in order. ``fuzzy`` False: the exact forward."""

    fuzzy: bool = False

    def enable_layer_parallel(self) -> None:
        self.fuzzy = False
        ws, norms = [], []
        for layer in self.layers:
            w = layer.qkv.weight().t()  # [in, out]
            ws.append(w * layer.input_norm[:, None])
            norms.append(layer.input_norm)
        self._qkv_all = torch.cat(ws, dim=1).contiguous()  # [hidden, layers * qkv]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        if not self.fuzzy:
            return super()._layers(x, positions, attention)
        cfg = self.config
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(x.dtype)
        qkv_all = (normed @ self._qkv_all).split((nh + 2 * nkv) * hd, dim=-1)  # per layer [T, qkv]
        outputs = []
        for local, qkv in enumerate(qkv_all):
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd)
            half = hd // 2
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
            outputs.append(attention(local, q, k, v))
        for layer, a in zip(self.layers, outputs):
            x = x + layer.o(a)
            h32 = x.float()
            h = layer.post_norm * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(x.dtype)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x


class DistilledDrafter:
    def __init__(self, stage: LlamaStage, vocabulary: Sequence[int], target_vocab_size: int,
                 config: DistilledConfig = DistilledConfig(), name: str = "distilled") -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError("a distilled drafter needs the whole model")
        self.stage, self.config, self.name = stage, config, name
        if config.layer_parallel:
            if not isinstance(stage, LayerParallelStage):
                raise ValueError("layer_parallel needs a LayerParallelStage")
            stage.enable_layer_parallel()
        self.to_target = torch.tensor([-1] + list(vocabulary), dtype=torch.long)  # compact -> target id
        self.to_compact = torch.zeros(target_vocab_size, dtype=torch.long)
        self.to_compact[self.to_target[1:]] = torch.arange(1, len(self.to_target))
        self.cache = stage.new_kv_cache()
        self._exact: dict[str, list[int]] = {}
        """Per request: the compact context whose KV the cache holds, every layer exact."""

    @property
    def num_tracked_requests(self) -> int:
        return len(self._exact)

    def release(self, request_id: str) -> None:
        self.cache.free(request_id)
        self._exact.pop(request_id, None)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass

    def _compact(self, tokens: Sequence[int]) -> list[int]:
        return self.to_compact[torch.tensor(list(tokens), dtype=torch.long)].tolist() if tokens else []

    def _pending(self, request_id: str, context: list[int]) -> list[int]:
        """Roll the cache back to the common prefix with ``context`` (compact ids); the tokens to run."""
        seen = self._exact.get(request_id)
        if seen is None:
            self.cache.allocate(request_id)
            seen = self._exact[request_id] = []
        common, limit = 0, min(len(seen), len(context) - 1)  # always re-run at least the root
        while common < limit and seen[common] == context[common]:
            common += 1
        self.cache.truncate(request_id, common)
        del seen[common:]
        return context[common:]

    def _forward(self, rids: list[str], chains: list[list[int]], fuzzy: bool) -> torch.Tensor:
        """One forward of these chains -> probabilities of the next compact token [len(rids), V]."""
        starts = [self.cache.committed_length(r) for r in rids]
        if isinstance(self.stage, LayerParallelStage):
            self.stage.fuzzy = fuzzy
        try:
            logits = self.stage.forward(StageBatch.from_chains(rids, chains, starts), self.cache)
        finally:
            if isinstance(self.stage, LayerParallelStage):
                self.stage.fuzzy = False
        for r in rids:
            self.cache.commit(r)
        logits[:, 0] = float("-inf")  # "another token" is never proposed
        return torch.softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def _chains(self, items: Sequence[tuple[str, list[int], int, int]]) -> list[list[Candidates]]:
        """items: (request id, target context ⊕ prefix, depth, k) with distinct request ids ->
        per item ``depth`` candidate lists, each after the top tokens of the earlier ones."""
        out: list[list[Candidates]] = [[] for _ in items]
        if not items:
            return out
        rids = [rid for rid, *_ in items]
        contexts = {rid: self._compact(ctx) for rid, ctx, *_ in items}
        chains = [self._pending(rid, contexts[rid]) for rid in rids]
        exact_len = {rid: len(contexts[rid]) for rid in rids}
        live = list(range(len(items)))
        first = True
        while live:
            probs = self._forward([rids[i] for i in live], [chains[i] for i in live],
                                  fuzzy=self.config.layer_parallel and not first)
            k = max(items[i][3] for i in live)
            top = probs.topk(k, dim=-1)
            still = []
            for row, i in enumerate(live):
                self._exact[rids[i]].extend(chains[i])
                cands = [(int(self.to_target[t]), float(p)) for t, p in
                         zip(top.indices[row, :items[i][3]].tolist(), top.values[row, :items[i][3]].tolist())]
                out[i].append(cands)
                if len(out[i]) < items[i][2]:
                    chains[i] = [int(top.indices[row, 0])]
                    still.append(i)
            live = still
            first = False
        if self.config.layer_parallel:  # bonus calibration: inexact draft KV goes; the next call reruns it
            for rid in rids:
                self.cache.truncate(rid, exact_len[rid])
                del self._exact[rid][exact_len[rid]:]
        return out

    def _by_slot(self, entries: Sequence[tuple[int, str, list[int], int, int]]) -> dict[int, list[Candidates]]:
        """Run entries (key, rid, context, depth, k) in rounds where no request appears twice."""
        out, pending = {}, list(entries)
        while pending:
            round_, seen, rest = [], set(), []
            for e in pending:
                (rest if e[1] in seen else round_).append(e)
                seen.add(e[1])
            for e, levels in zip(round_, self._chains([e[1:] for e in round_])):
                out[e[0]] = levels
            pending = rest
        return out

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return one_level_chains(self, queries)

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        entries = [((qi, si), q.request_id, list(q.context_token_ids) + list(p), 1, q.k)
                   for qi, q in enumerate(queries) if q.k > 0 for si, p in enumerate(q.prefixes)]
        done = self._by_slot(entries)
        return [[(done.get((qi, si)) or [[]])[0] for si in range(len(q.prefixes))] for qi, q in enumerate(queries)]

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        active = [inp for inp in inputs if inp.max_draft_tokens > 0]
        levels = self._chains([(inp.request_id, list(inp.context_token_ids), inp.max_draft_tokens, 2)
                               for inp in active])
        by_id = dict(zip((inp.request_id for inp in active), levels))
        out = []
        for inp in inputs:
            lv = by_id.get(inp.request_id)
            if not lv or not lv[0]:
                out.append(DraftProposal.empty(inp.request_id, self.name))
                continue
            paths, confs = [[c[0][0] for c in lv]], [[c[0][1] for c in lv]]
            if self.config.first_branch and len(lv[0]) > 1 and len(lv) < inp.max_draft_tokens:
                paths.append([lv[0][1][0]])
                confs.append([lv[0][1][1]])
            out.append(DraftProposal(inp.request_id, paths, confs, self.name))
        return out


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token → id): a drafter records its target's."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps(items).encode()).hexdigest()[:16]


def read_drafter_metadata(folder: str | Path) -> dict:
    path = Path(folder) / DRAFTER_METADATA
    if not path.is_file():
        raise ValueError(f"{folder} has no {DRAFTER_METADATA}; is it a drafter written by `cosine-ray distill`?")
    return json.loads(path.read_text())


def load_distilled(folder: str | Path, target_vocab_size: int, *, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", config: DistilledConfig = DistilledConfig(),
                   name: str | None = None) -> DistilledDrafter:
    """A distilled domain drafter from its folder (``cosine-ray distill``'s output)."""
    from cosine_ray.models.loader import resolve_checkpoint
    meta = read_drafter_metadata(folder)
    if meta.get("kind") != "domain":
        raise ValueError(f"{folder} holds a {meta.get('kind')!r} drafter, not a domain drafter")
    vocab = meta["vocabulary"]
    if int(meta.get("target_vocab_size", target_vocab_size)) != target_vocab_size or max(vocab) >= target_vocab_size:
        raise ValueError(f"drafter {folder} was distilled for a vocabulary of {meta.get('target_vocab_size')} "
                         f"tokens, the target has {target_vocab_size}; drafters must share the target's tokenizer")
    ckpt = resolve_checkpoint(folder)
    cls = LayerParallelStage if config.layer_parallel else LlamaStage
    stage = cls(ckpt.config, ckpt.load_state_dict(), dtype=dtype, device=device)
    return DistilledDrafter(stage, vocab, target_vocab_size, config, name or f"distilled:{meta.get('domain', '')}")
