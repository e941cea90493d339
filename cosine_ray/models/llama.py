"""Our own compact Llama-family forward pass over a contiguous slice of layers.

``LlamaStage(config, state_dict, layer_start, layer_end)`` holds layers [a, b) of the
model: the embedding when a == 0, the final norm and lm_head when b == num_layers. A
pipeline stage of the verification server is one such slice; the whole model is the
slice [0, num_layers).

One call runs a *varlen batch*: the new tokens of every request are flattened into one
``[num_tokens, hidden]`` matrix so all projections and MLPs are single matmuls, and only
attention is per request, over that request's KV cache (committed level + this step's
nodes). Each request's new tokens are either a chain (prefill / plain decode: causal) or
a token tree (ancestor mask from ``TokenTree.attention_mask``, depth-based positions).

NOTE(lead): numerics follow transformers' Llama (fp32 RMSNorm, rotate-half RoPE,
``inv_freq`` computed in float32 with int64 arange) so logits match HF within 1e-4 fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from cosine_ray.models.config import ModelConfig
from cosine_ray.models.kv_cache import KVCache


@dataclass(slots=True)
class StageBatch:
    """What one stage forward needs; built once per step and passed down the stage chain."""

    request_ids: list[str]
    num_new_tokens: list[int]
    """Tokens per request in this step (flattened in request order)."""
    positions: torch.Tensor  # [num_tokens] int64, absolute RoPE positions
    tree_masks: list[torch.Tensor | None]
    """Per request: [n_i, n_i] bool ancestor mask of its tree, or None for a causal chain."""
    logit_indices: torch.Tensor | None = None  # [num_logits] rows that need logits; None = all
    token_ids: torch.Tensor | None = None  # [num_tokens] int64, used by the first stage

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def from_chains(cls, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                    start_positions: Sequence[int], *, last_logits_only: bool = True) -> "StageBatch":
        """Each request appends a plain causal chain (prefill or plain decode)."""
        counts = [len(t) for t in token_ids]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, counts)])
        flat = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long)
        logit_indices = (torch.tensor(counts).cumsum(0) - 1) if last_logits_only else None
        return cls(list(request_ids), counts, positions, [None] * len(counts), logit_indices, flat)


def _rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling:  # llama3 frequency-dependent scaling (transformers' _compute_llama3_parameters)
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(slots=True)
class _Layer:
    """Projection weights are stored transposed, ``[in, out]``, and applied as ``x @ w_t``:
    on CPU, for the 2-16 tokens of a verify step, MKL's GEMM with the weight as the
    contiguous right operand is 1.3-1.7x faster than ``F.linear`` with the checkpoint's
    ``[out, in]`` layout (single thread, SmolLM2 shapes; equal at 1 token)."""
    input_norm: torch.Tensor
    qkv_t: torch.Tensor  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor  # [num_heads * head_dim, hidden]
    post_norm: torch.Tensor
    gate_up_t: torch.Tensor  # [hidden, 2 * intermediate]
    down_t: torch.Tensor  # [intermediate, hidden]
    mlp_biases: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


class LlamaStage:
    def __init__(self, config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                 layer_start: int = 0, layer_end: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        layer_end = config.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= config.num_layers:
            raise ValueError(f"layer slice [{layer_start}, {layer_end}) is not inside "
                             f"[0, {config.num_layers})")
        self.config = config
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == config.num_layers
        self.dtype, self.device = dtype, torch.device(device)

        def get(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype).contiguous()

        def get_optional(name: str) -> torch.Tensor | None:
            return get(name) if name in state_dict else None

        def transposed(weight: torch.Tensor) -> torch.Tensor:
            return weight.t().contiguous()

        self.embed_weight = get("model.embed_tokens.weight") if self.is_first else None
        self.layers: list[_Layer] = []
        for i in range(layer_start, layer_end):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([get(f"{a}.bias") for a in attn])
            mlp_biases = None
            if config.mlp_bias:
                mlp_biases = (torch.cat([get(f"{p}mlp.gate_proj.bias"), get(f"{p}mlp.up_proj.bias")]),
                              get(f"{p}mlp.down_proj.bias"))
            self.layers.append(_Layer(
                input_norm=get(f"{p}input_layernorm.weight"),
                qkv_t=transposed(torch.cat([get(f"{a}.weight") for a in attn])),
                qkv_bias=qkv_bias,
                o_t=transposed(get(f"{p}self_attn.o_proj.weight")),
                post_norm=get(f"{p}post_attention_layernorm.weight"),
                gate_up_t=transposed(torch.cat([get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")])),
                down_t=transposed(get(f"{p}mlp.down_proj.weight")),
                mlp_biases=mlp_biases,
            ))
        self.norm_weight = get("model.norm.weight") if self.is_last else None
        self.lm_head_t = None
        """[hidden, vocab]; with tied embeddings a transposed copy of the embedding."""
        if self.is_last:
            head = get_optional("lm_head.weight")
            if head is None:  # tied embeddings
                head = self.embed_weight if self.embed_weight is not None else get("model.embed_tokens.weight")
            self.lm_head_t = transposed(head)
        self.inv_freq = _rope_inv_freq(config).to(self.device)
        self.attention_scale = config.head_dim ** -0.5

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def new_kv_cache(self, **kwargs) -> KVCache:
        return KVCache(self.num_layers, self.config.num_kv_heads, self.config.head_dim,
                       dtype=self.dtype, device=self.device, **kwargs)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids  # [n] -> [n, hidden] with the target's input embedding H(·) (eq. 1)."""
        weight = self.embed_weight
        if weight is None:
            raise RuntimeError("only the first stage holds the embedding")
        return F.embedding(token_ids.to(self.device), weight)

    @torch.inference_mode()
    def forward(self, batch: StageBatch, kv_cache: KVCache,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this slice. Returns hidden states [num_tokens, hidden], or on the last stage
        logits [num_logits, vocab] (fp32) for ``batch.logit_indices``.

        Writes each request's new keys/values into the speculative level of ``kv_cache``;
        the caller commits or drops them after verification.
        """
        cfg = self.config
        if self.is_first:
            assert batch.token_ids is not None and batch.token_ids.ndim == 1
            x = self.embed(batch.token_ids)
        else:
            assert hidden is not None and hidden.shape == (batch.num_tokens, cfg.hidden_size)
            x = hidden.to(device=self.device, dtype=self.dtype)

        positions = batch.positions.to(self.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]  # [T, 1, head_dim]
        sin = emb.sin().to(self.dtype)[:, None, :]

        # per request: slice of the flat batch, cache slots, and attention mask over the cache
        starts, masks = [], []
        offset = 0
        for rid, n, tree_mask in zip(batch.request_ids, batch.num_new_tokens, batch.tree_masks):
            slot = kv_cache.reserve(rid, n)
            starts.append((offset, slot))
            offset += n
            masks.append(self._attention_mask(slot, n, tree_mask))

        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for local, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = h @ layer.qkv_t if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, h, layer.qkv_t)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(-1, nh, hd)
            k = k.view(-1, nkv, hd)
            v = v.view(-1, nkv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            outs = []
            for (off, slot), rid, n, mask in zip(starts, batch.request_ids, batch.num_new_tokens, masks):
                kv_cache.write(rid, local, slot, k[off:off + n].transpose(0, 1), v[off:off + n].transpose(0, 1))
                keys, values = kv_cache.view(rid, local, slot + n)
                out = F.scaled_dot_product_attention(
                    q[off:off + n].transpose(0, 1)[None], keys[None], values[None],
                    attn_mask=mask if isinstance(mask, torch.Tensor) else None,
                    is_causal=isinstance(mask, str), scale=self.attention_scale, enable_gqa=nkv != nh)
                outs.append(out[0].transpose(0, 1).reshape(n, nh * hd))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + attn @ layer.o_t
            h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            if layer.mlp_biases is None:
                gate, up = (h @ layer.gate_up_t).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ layer.down_t
            else:
                gate, up = torch.addmm(layer.mlp_biases[0], h, layer.gate_up_t).chunk(2, dim=-1)
                x = x + torch.addmm(layer.mlp_biases[1], F.silu(gate) * up, layer.down_t)

        if not self.is_last:
            return x
        if batch.logit_indices is not None:
            x = x[batch.logit_indices.to(self.device)]
        x = _rms_norm(x, self.norm_weight, cfg.rms_norm_eps)
        return (x @ self.lm_head_t).float()

    def _attention_mask(self, slot: int, n: int, tree_mask: torch.Tensor | None):
        """Mask of n new tokens over slots [0, slot + n): ``None`` (attend to all, n == 1),
        ``"causal"`` (fresh chain), or a bool tensor [n, slot + n]."""
        if tree_mask is None:
            if n == 1:
                return None
            if slot == 0:
                return "causal"
            tree_mask = torch.ones(n, n, dtype=torch.bool).tril_()
        assert tree_mask.shape == (n, n), f"tree mask {tuple(tree_mask.shape)} for {n} tokens"
        mask = torch.ones(n, slot + n, dtype=torch.bool)
        mask[:, slot:] = tree_mask
        return mask.to(self.device)
