"""Greedy references from an independent run: Hugging Face transformers, fp32, on this machine.

A lossless server's greedy answer is the target model's own greedy decoding, so the audit does
not take the server's word for it: every ``independent`` shape (greedy, no grammar) is decoded
here with ``generate`` (fp32, no sampling), its prompt built as the server builds it (the chat
template with the generation prompt, or the tokenizer with special tokens), its text decoded
without special tokens and cut before the first stop string. A shape whose greedy path passes
a near tie (top-2 logit gap under ``NEAR_TIE`` among the tokens kept: fp32 sums in another
order may flip it) gets no independent reference; it is checked against the server's answer
before the chaos, like seeded and constrained shapes, and counted.

``--reference-model auto`` looks for the served model's Hugging Face directory in cosine_ray's
model cache (``$COSINE_RAY_CACHE/models/NAME``, else ``~/.cache/cosine_ray/models/NAME``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

from loadgen.chaos.shapes import CHAT, Shape

NEAR_TIE = 1e-3


class NoReferenceModel(ValueError):
    """No usable reference model (exit 2)."""


def resolve_reference_model(spec: str, served_model: str | None) -> Path | None:
    """The HF directory to decode with, or None (``none``: the server's own warm-up answers)."""
    if spec == "none":
        return None
    if spec != "auto":
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise NoReferenceModel(f"--reference-model {spec}: not a Hugging Face model directory (no config.json)")
        return path
    roots = [Path(os.environ["COSINE_RAY_CACHE"])] if os.environ.get("COSINE_RAY_CACHE") else []
    roots.append(Path.home() / ".cache" / "cosine_ray")
    for root in roots:
        path = root / "models" / str(served_model)
        if served_model and (path / "config.json").is_file():
            return path
    raise NoReferenceModel(f"--reference-model auto: no Hugging Face directory for the served model "
                          f"{served_model!r} under {', '.join(str(r / 'models') for r in roots)}; pass "
                          f"--reference-model DIR, or none to check greedy answers against the server's own")


def hf_references(model_dir: Path, shapes: Sequence[Shape],
                  log: Callable[[str], None] = print) -> tuple[dict[str, list[str]], list[str]]:
    """(texts per independent shape, one per choice; keys of the shapes left out for a near tie)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts: dict[str, list[str]] = {}
    near_ties: list[str] = []
    for shape in (s for s in shapes if s.independent):
        ids = prompt_ids(tokenizer, shape)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=shape.max_tokens, do_sample=False, num_beams=1, temperature=None,
                                 top_p=None, top_k=None, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=model.generation_config.pad_token_id or 0)
        new = out.sequences[0, len(ids):].tolist()
        kept = kept_tokens(tokenizer, new, shape.stop)
        gaps = [float(score[0].topk(2).values.diff().abs()) for score in out.scores[:kept]]
        if gaps and min(gaps) < NEAR_TIE:
            near_ties.append(shape.key)
            continue
        texts[shape.key] = [cut(tokenizer.decode(new, skip_special_tokens=True), shape.stop)] * shape.n
    log(f"[chaos] HF fp32 greedy references from {model_dir}: {len(texts)} shapes"
        + (f", {len(near_ties)} left to the warm-up (near tie)" if near_ties else ""))
    return texts, near_ties


def prompt_ids(tokenizer, shape: Shape) -> list[int]:
    if shape.path == CHAT:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": shape.prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(shape.prompt, add_special_tokens=True)["input_ids"]]


def cut(text: str, stop: Sequence[str]) -> str:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(hits)] if hits else text


def kept_tokens(tokenizer, token_ids: list[int], stop: Sequence[str]) -> int:
    """How many of ``token_ids`` the answer keeps: up to the one that completes a stop string."""
    if not stop:
        return len(token_ids)
    for n in range(1, len(token_ids) + 1):
        if cut(tokenizer.decode(token_ids[:n], skip_special_tokens=True), stop) != \
                tokenizer.decode(token_ids[:n], skip_special_tokens=True):
            return n
    return len(token_ids)
