"""The reference every lossless test compares with: Hugging Face ``generate`` greedy, fp32."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of ``prompt_ids`` (``max_new_tokens`` tokens, fewer at EOS)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                             pad_token_id=model.generation_config.pad_token_id or 0)
    return out[0, len(prompt_ids):].tolist()
