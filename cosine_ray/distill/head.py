"""Train a feature head (EAGLE) on the target's own features (``engine.drafters.models.head_model``).

At every position j of a sequence the head reads ``[E(x_{j+1}); f_j]`` and is trained towards
the target's next feature f_{j+1} (smooth-L1, EAGLE's regression loss) and, through the target's
frozen LM head, towards the target's top-k distribution at j + 1 (cross-entropy over the head's
vocabulary, ``cls_weight``). Input features get uniform noise of ``noise`` × their standard
deviation (EAGLE's robustness to its own predicted features at deeper draft levels). The
decoder layer starts as the target's last layer and ``fc`` as the sum of embedding and feature.
Seeded: the same data and config give the same weights on the same machine.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from cosine_ray.distill.dataset import TrainSequence, batches
from cosine_ray.engine.drafters.models.head_model import FeatureHead, HeadConfig


@dataclass(frozen=True, slots=True)
class HeadTrainConfig:
    vocab_size: int = 8192
    """Target tokens the head drafts (the most frequent over all the data)."""
    epochs: int = 10
    lr: float = 2e-3
    cls_weight: float = 0.5
    """Weight of the top-k cross-entropy against the feature regression."""
    noise: float = 0.1
    """Uniform input-feature noise, in feature standard deviations."""
    batch_tokens: int = 256
    seed: int = 0
    threads: int = 2


def _batch_tensors(batch: Sequence[TrainSequence], embedding: torch.Tensor):
    """Inputs and targets of a batch, rows j = 0..T-2 of each sequence (right-padded)."""
    longest = max(len(s.token_ids) for s in batch) - 1
    h = embedding.shape[1]
    k = batch[0].topk_ids.shape[1]
    emb = torch.zeros(len(batch), longest, h)
    feat = torch.zeros(len(batch), longest, h)
    nxt = torch.zeros(len(batch), longest, h)
    top_ids = torch.zeros(len(batch), longest, k, dtype=torch.long)
    top_p = torch.zeros(len(batch), longest, k)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    output_rows = torch.zeros(len(batch), longest, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.token_ids) - 1
        f = s.features.float()
        emb[i, :n] = embedding[s.token_ids[1:]]
        feat[i, :n], nxt[i, :n] = f[:-1], f[1:]
        top_ids[i, :n], top_p[i, :n] = s.topk_ids[1:], s.topk_logprobs[1:].exp()
        mask[i, :n] = True
        output_rows[i, max(0, s.prompt_len - 2):n - 1] = True  # row j drafts x_{j+2}: output from P - 2 on
    positions = torch.arange(longest).expand(len(batch), longest)
    return (emb, feat, nxt, top_ids, top_p / top_p.sum(-1, keepdim=True).clamp_min(1e-9), mask, positions,
            output_rows)


def head_loss(head: FeatureHead, batch: Sequence[TrainSequence], embedding: torch.Tensor, rows: torch.Tensor,
              to_vocab: torch.Tensor, config: HeadTrainConfig, noise_scale: float, gen: torch.Generator | None
              ) -> tuple[torch.Tensor, int]:
    """(loss, positions). ``rows``  # [V, H]: the LM head's rows of the head's vocabulary;
    ``to_vocab``  # [target vocab]: a target id's index in it, -1 outside."""
    emb, feat, nxt, top_ids, top_p, mask, positions, _ = _batch_tensors(batch, embedding)
    if gen is not None and config.noise > 0:
        feat = feat + (torch.rand(feat.shape, generator=gen) * 2 - 1) * config.noise * noise_scale
    g = head(emb, feat, positions)  # [B, L, H]
    reg = F.smooth_l1_loss(g, nxt, reduction="none").mean(-1)  # [B, L]
    idx = to_vocab[top_ids]  # [B, L, k], -1 outside the vocabulary
    p = top_p * (idx >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    logprobs = torch.log_softmax(g @ rows.T, dim=-1)  # [B, L, V]
    ce = -(p * logprobs.gather(-1, idx.clamp_min(0))).sum(-1)
    n = int(mask.sum())
    return ((reg + config.cls_weight * ce) * mask).sum() / max(n, 1), n


def evaluate_head(head: FeatureHead, sequences: Sequence[TrainSequence], embedding: torch.Tensor,
                  lm_head_rows: torch.Tensor, vocab: torch.Tensor, batch_tokens: int) -> dict:
    """Top-1 agreement with the target's next-next token over the head's whole vocabulary, on
    the rows that draft an output token (what the head does in the engine)."""
    head.eval()
    n = hits = 0
    with torch.no_grad():
        for batch in batches(sequences, batch_tokens, random.Random(0)):
            emb, feat, _, top_ids, _, _, positions, rows = _batch_tensors(batch, embedding)
            g = head(emb, feat, positions)
            pred = vocab[(g @ lm_head_rows.T).argmax(-1)]  # [B, L]
            hits += int(((pred == top_ids[..., 0]) & rows).sum())
            n += int(rows.sum())
    return {"top1": hits / max(n, 1), "positions": n}


def train_head(target_config, target_state: dict[str, torch.Tensor], train: Sequence[TrainSequence],
               val: Sequence[TrainSequence], vocabulary: Sequence[int], config: HeadTrainConfig,
               log: Callable[[str], None] = print) -> tuple[FeatureHead, dict]:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    embedding = target_state["model.embed_tokens.weight"].float()
    lm_head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"]).float()
    vocab = torch.tensor(list(vocabulary), dtype=torch.long)
    head = FeatureHead(HeadConfig.like(target_config))
    head.init_from_target(target_state, target_config.num_layers - 1)
    noise_scale = float(torch.cat([s.features[:64].float() for s in train[:64]]).std()) if train else 1.0
    gen = torch.Generator().manual_seed(config.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    rng = random.Random(config.seed)
    plan = [batches(train, config.batch_tokens, rng) for _ in range(config.epochs)]
    total = sum(len(p) for p in plan)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, total // 20))
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    rows = lm_head[vocab]
    to_vocab = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    record = {"before": evaluate_head(head, val, embedding, rows, vocab, config.batch_tokens) if val else None,
              "epochs": []}
    start = time.perf_counter()
    for epoch, epoch_batches in enumerate(plan):
        head.train()
        seen = loss_sum = 0
        for batch in epoch_batches:
            loss, n = head_loss(head, batch, embedding, rows, to_vocab, config, noise_scale, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            seen, loss_sum = seen + n, loss_sum + float(loss.detach()) * n
        ev = evaluate_head(head, val, embedding, rows, vocab, config.batch_tokens) if val else None
        record["epochs"].append({"train_loss": loss_sum / max(seen, 1), "val": ev,
                                 "seconds": round(time.perf_counter() - start, 1)})
        log(f"  epoch {epoch + 1}/{config.epochs}: train loss {loss_sum / max(seen, 1):.4f}"
            + (f", held-out top-1 agreement {ev['top1']:.3f}" if ev else ""))
    record["seconds"] = round(time.perf_counter() - start, 1)
    return head, record


def config_dict(config: HeadTrainConfig) -> dict:
    return asdict(config)
