"""The feature head's network (EAGLE's draft head), shared by training and drafting.

Terms: at position j the target has token x_j and feature f_j (its final-norm hidden state,
``engine.worker.features``), and f_j's LM-head row predicts x_{j+1}. The head reads
``[E(x_{j+1}); f_j]`` (E: the target's input embedding), mixes it to the hidden size (``fc``),
runs one Llama decoder layer with causal attention over the earlier positions, and outputs
g_j ≈ f_{j+1}; the target's LM head (restricted to a vocabulary, ``vocab``) scores g_j into the
distribution of x_{j+2}. Drafting feeds g_j back as the next position's feature.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class HeadConfig:
    hidden_size: int
    """The target's hidden size (features and embeddings)."""
    intermediate_size: int
    """The decoder layer's MLP width."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def like(cls, model_config) -> "HeadConfig":
        """The target's layer shape (a ``models.config.ModelConfig``)."""
        c = model_config
        return cls(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                   c.rope_theta)

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x  # [..., T, heads, head_dim] rotated by positions [..., T] (rotate-half RoPE)."""
    freqs = positions[..., None].float() * inv_freq  # [..., T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # [..., T, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q, k, v) of the new rows -> attention output; it owns the KV and the mask."""


class FeatureHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = self.config = config
        h, hd = c.hidden_size, c.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, c.num_heads * hd, bias=False)
        self.k = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(c.num_heads * hd, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate = nn.Linear(h, c.intermediate_size, bias=False)
        self.up = nn.Linear(h, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_from_target(self, state: dict[str, torch.Tensor], layer: int) -> None:
        """Start as the identity on the feature: ``fc`` passes f_j through, the layer's q/k/v and
        MLP input projections are the target's ``layer``'s and its two output projections are
        zero (so g_j = f_j until training moves them)."""
        p = f"model.layers.{layer}."
        with torch.no_grad():
            for mine, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                                 ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj")):
                getattr(self, mine).weight.copy_(state[p + theirs + ".weight"])
            self.o.weight.zero_()
            self.down.weight.zero_()
            self.input_norm.copy_(state[p + "input_layernorm.weight"])
            self.post_norm.copy_(state[p + "post_attention_layernorm.weight"])
            h = self.config.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x  # [..., T, hidden] after ``fc`` -> rotated q [..., T, heads, hd], k, v [..., T, kv_heads, hd]."""
        c = self.config
        hn = rms_norm(x, self.input_norm, c.rms_norm_eps)
        q = self.q(hn).unflatten(-1, (c.num_heads, c.head_dim))
        k = self.k(hn).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = self.v(hn).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq), v

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attend: Attend | None = None) -> torch.Tensor:
        """embeddings, features  # [..., T, hidden] (E(x_{j+1}), f_j), positions [..., T] -> g [..., T, hidden].
        ``attend`` None: causal attention over the T rows (training, [B, T, ...])."""
        x = self.fc(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))
        q, k, v = self.qkv(x, positions)
        if attend is None:
            groups = self.config.num_heads // self.config.num_kv_heads
            a = F.scaled_dot_product_attention(q.transpose(-3, -2), k.repeat_interleave(groups, -2).transpose(-3, -2),
                                               v.repeat_interleave(groups, -2).transpose(-3, -2),
                                               is_causal=True).transpose(-3, -2)
        else:
            a = attend(q, k, v)
        x = x + self.o(a.flatten(-2))
        hn = rms_norm(x, self.post_norm, self.config.rms_norm_eps)
        return x + self.down(F.silu(self.gate(hn)) * self.up(hn))
