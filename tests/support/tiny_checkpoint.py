"""Tiny random-weight checkpoints for tests: ``write_tiny_checkpoint`` writes a small
Llama/Qwen2/Mistral Hugging Face directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from cosine_ray.models.checkpoint import Checkpoint, ModelLoadError
from cosine_ray.models.conversion import _MARKER, _save_hf_dir
from cosine_ray.models.loader import _read_hf_dir

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_NON_TOKENIZER_FILES = {"config.json", "generation_config.json", _MARKER}


def write_tiny_checkpoint(
    path: Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tokenizer_from: Checkpoint | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    model_type: str = "llama",
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    eos_token_id: int | list[int] | None = None,
    name: str | None = None,
) -> Checkpoint:
    """Write a random-weight tiny Llama/Qwen2/Mistral HF directory at ``path``.

    With ``tokenizer_from`` its tokenizer files are copied and its vocab size and bos/eos/pad
    ids are used; otherwise ``vocab_size`` defaults to 256, no tokenizer is written and there is
    no EOS token unless ``eos_token_id`` is given. Weights are N(0, init_std) (a large std, so
    greedy logits are far from ties), RMSNorm weights 1 + N(0, 0.1); deterministic in ``seed``.
    qwen2 models get q/k/v biases (HF Qwen2 always has them).
    """
    import torch
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    path = Path(path)
    bos = pad = None
    eos = eos_token_id
    if tokenizer_from is not None:
        src_cfg = tokenizer_from.hf_config
        if vocab_size is None:
            vocab_size = int(tokenizer_from.config.vocab_size)
        bos = getattr(src_cfg, "bos_token_id", None)
        pad = getattr(src_cfg, "pad_token_id", None)
        if eos is None:
            ids = list(tokenizer_from.config.eos_token_ids)
            eos = ids[0] if len(ids) == 1 else (ids or None)
    if vocab_size is None:
        vocab_size = 256
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        head_dim=hidden_size // num_heads, dtype="float32",
    )
    if model_type == "llama":
        hf_config = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        arch = "LlamaForCausalLM"
    elif model_type == "mistral":
        hf_config = MistralConfig(sliding_window=None, **common)
        arch = "MistralForCausalLM"
    elif model_type == "qwen2":
        hf_config = Qwen2Config(use_sliding_window=False, **common)
        arch = "Qwen2ForCausalLM"
    else:
        raise ModelLoadError(f"write_tiny_checkpoint: model_type {model_type!r} is not one of "
                             f"llama, mistral, qwen2")
    hf_config.architectures = [arch]

    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape)) for k, v in
                  AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for k in sorted(shapes):
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k == "lm_head.weight" and tie_word_embeddings:
            continue
        shape = shapes[k]
        if k.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = init_std * torch.randn(shape, generator=gen)
        state[k] = t.to(torch.float32)

    path.mkdir(parents=True, exist_ok=True)
    _save_hf_dir(path, hf_config, state)
    if tokenizer_from is not None:
        src = tokenizer_from.path
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NON_TOKENIZER_FILES
                    and not f.name.endswith(_WEIGHT_SUFFIXES + (".gguf", ".index.json"))
                    and not f.name.startswith(".")):
                shutil.copyfile(f, path / f.name)
    return _read_hf_dir(path, name or path.name)
