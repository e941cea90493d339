"""Training sequences from the teacher's shards, and the frequency-ranked vocabularies.

A ``Sequence`` is one answer record as the teacher saw it: token ids [T], the target's top-k
next tokens and log-probabilities [T, k], its features [T, H] (when kept), and the prompt
length. ``frequent_vocabulary`` is FR-Spec's sub-vocabulary: the tokens a domain's text uses
most, counting each position's own token once and each of the target's top-k candidates by
its probability (so a likely alternative the text happened not to use still ranks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from cosine_ray.distill.teacher import load_shard, shard_files


@dataclass(frozen=True, slots=True)
class TrainSequence:
    key: str
    domain: str
    token_ids: torch.Tensor  # [T] int64
    topk_ids: torch.Tensor  # [T, k] int64
    topk_logprobs: torch.Tensor  # [T, k] float32
    features: torch.Tensor | None  # [T, H] float16
    prompt_len: int


def load_sequences(folder: str | Path, domains: Iterable[str] | None = None,
                   keys: set[str] | None = None) -> list[TrainSequence]:
    """Every sequence of the shards in ``folder`` (of ``domains``, and ``keys`` when given), by
    key; a key two shards hold (two passes that overlapped) counts once."""
    wanted = set(domains) if domains is not None else None
    out, seen = [], set()
    for f in shard_files(folder):
        shard = load_shard(f)
        for i, (key, domain) in enumerate(zip(shard.keys, shard.domains)):
            if (wanted is not None and domain not in wanted) or (keys is not None and key not in keys) or key in seen:
                continue
            seen.add(key)
            rows = shard.sequence(i)
            out.append(TrainSequence(key, domain, shard.token_ids[rows].long(), shard.topk_ids[rows].long(),
                                     shard.topk_logprobs[rows].float(),
                                     None if shard.features is None else shard.features[rows],
                                     int(shard.prompt_lens[i])))
    return sorted(out, key=lambda s: s.key)


def frequent_vocabulary(sequences: Sequence[TrainSequence], size: int, *, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent target tokens of ``sequences`` (``always`` first), most frequent first."""
    n = 1 + max(max(int(s.token_ids.max()), int(s.topk_ids.max())) for s in sequences)
    counts = torch.zeros(n, dtype=torch.float64)
    for s in sequences:
        counts += torch.bincount(s.token_ids, minlength=n).double()
        counts += torch.bincount(s.topk_ids.flatten(), weights=s.topk_logprobs.exp().flatten().double(), minlength=n)
    order = sorted(range(n), key=lambda t: (-float(counts[t]), t))
    ranked = list(dict.fromkeys(list(always) + [t for t in order if counts[t] > 0]))
    return ranked[:size]


def coverage(sequences: Sequence[TrainSequence], vocabulary: Iterable[int]) -> float:
    """Share of the sequences' output tokens (after the prompt) inside ``vocabulary``."""
    vocab = set(vocabulary)
    total = inside = 0
    for s in sequences:
        out = s.token_ids[s.prompt_len:].tolist()
        total += len(out)
        inside += sum(t in vocab for t in out)
    return inside / total if total else 0.0


def batches(sequences: Sequence[TrainSequence], batch_tokens: int, rng: random.Random) -> list[list[TrainSequence]]:
    """Shuffled batches of similar-length sequences, each at most ``batch_tokens`` padded tokens."""
    order = sorted(sequences, key=lambda s: (len(s.token_ids), s.key))
    out, current = [], []
    for s in order:
        if current and (len(current) + 1) * len(s.token_ids) > batch_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def split_validation(sequences: Sequence[TrainSequence], share: float, seed: int
                     ) -> tuple[list[TrainSequence], list[TrainSequence]]:
    """(train, validation): a seeded ``share`` of the prompts held out (all samples of a prompt
    together, so validation never sees a prompt training saw)."""
    prompts = sorted({s.key.rsplit("/", 1)[0] for s in sequences})
    rng = random.Random(seed)
    held = set(rng.sample(prompts, int(round(share * len(prompts))))) if share > 0 else set()
    train = [s for s in sequences if s.key.rsplit("/", 1)[0] not in held]
    val = [s for s in sequences if s.key.rsplit("/", 1)[0] in held]
    return train, val
