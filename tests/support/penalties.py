"""Greedy decoding with the sampling penalties, computed apart from the engine's
``algo.logits_rules``: HF transformers' logits, HF's own ``RepetitionPenaltyLogitsProcessor``
(CTRL's penalty over the prompt and the output) and a plain count of the output's tokens for
OpenAI's presence and frequency penalties (minus ``presence`` once and minus ``frequency`` per
occurrence, over the output only), applied in vLLM's order: bias, repetition, frequency and
presence. A rule the engine ignored or computed wrongly gives another text than this."""

from __future__ import annotations

from collections import Counter

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor


def penalized_greedy(model, prompt_ids: list[int], max_new_tokens: int, *, presence: float = 0.0,
                     frequency: float = 0.0, repetition: float = 1.0,
                     logit_bias: dict[int, float] | None = None) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt_ids`` (no stop at EOS)."""
    repeat = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    out: list[int] = []
    for _ in range(max_new_tokens):
        ids = torch.tensor([prompt_ids + out])
        with torch.no_grad():
            scores = model(ids).logits[:, -1].float()
        for token, bias in (logit_bias or {}).items():
            scores[0, token] += bias
        if repeat is not None:
            scores = repeat(ids, scores)
        for token, count in Counter(out).items():
            scores[0, token] -= frequency * count + presence
        out.append(int(scores.argmax()))
    return out
