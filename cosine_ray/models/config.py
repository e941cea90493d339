"""Architecture of a Llama-family causal LM, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    """HF ``model_type``; one of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = None
    """HF rope parameters when not the default rope (only ``llama3`` scaling is supported)."""
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"cosine_ray runs {', '.join(SUPPORTED_MODEL_TYPES)} models")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any) -> "ModelConfig":
        """Build from a transformers config object or its ``to_dict()``."""
        d = dict(hf if isinstance(hf, Mapping) else hf.to_dict())
        model_type = d.get("model_type", "llama")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (default and llama3 are)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
        )


def stage_slices(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers [0, num_layers) into ``num_stages`` contiguous slices, sizes within one."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be between 1 and the model's {num_layers} layers, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
