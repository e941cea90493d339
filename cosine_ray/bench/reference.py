"""The lossless reference: Hugging Face transformers' greedy decoding, which benchmarks,
``cosine-ray bench`` and the tests compare our tokens with (fp32 unless the caller loaded the
model otherwise)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


def hf_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
                **kwargs: Any) -> Any:
    """``model.generate`` of one prompt, greedy, on the model's device; ``kwargs`` go to
    ``generate`` (``prompt_lookup_num_tokens``, ``output_logits``, ...)."""
    import torch
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    config = model.generation_config
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                              eos_token_id=None if ignore_eos else config.eos_token_id,
                              pad_token_id=config.pad_token_id or 0, **kwargs)


def hf_greedy(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
              **kwargs: Any) -> list[int]:
    """HF greedy continuation of ``prompt_ids``: ``max_new_tokens`` tokens, fewer at EOS unless
    ``ignore_eos``."""
    out = hf_generate(model, prompt_ids, max_new_tokens, ignore_eos=ignore_eos, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_with_logits(model: Any, prompt_ids: Sequence[int],
                          max_new_tokens: int) -> tuple[list[int], list["torch.Tensor"]]:
    """``hf_greedy`` and the logits (fp32, one row a new token) it chose each token from."""
    out = hf_generate(model, prompt_ids, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [lg[0].float() for lg in out.logits]


def hf_greedy_all(checkpoint: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  ignore_eos: bool = False) -> list[list[int]]:
    """Every prompt's reference, from ``checkpoint``'s transformers model loaded in fp32."""
    model = checkpoint.load_hf_model()
    return [hf_greedy(model, p, max_new_tokens, ignore_eos=ignore_eos) for p in prompts]


def count_identical(outputs: Sequence[Any], references: Sequence[Any]) -> str:
    """``same/total``: how many outputs equal their reference, pair by pair."""
    return f"{sum(a == b for a, b in zip(outputs, references))}/{len(references)}"
