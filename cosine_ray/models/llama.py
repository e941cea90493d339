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

Numerics follow transformers' Llama (fp32 RMSNorm, rotate-half RoPE, ``inv_freq`` computed in
float32 with int64 arange), so logits match HF's within 1e-4 in fp32. The projections
(``models.linear``) and, on CPU, the fused layers (``models.kernels``) are chosen at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from cosine_ray.models import kernels
from cosine_ray.models.attention import (AttentionPlan, PaddedInputs, attend, attend_padded, eager_attention,
                                         padded_plan, plan_attention, query_bucket)
from cosine_ray.models.config import ModelConfig
from cosine_ray.models.kv_cache import KVCache
from cosine_ray.models.linear import DenseLinear, Projection, bf16_activations, kernel_operand, projection
from cosine_ray.models.weights.quant import QuantEmbedding, as_dense, is_quantized


@dataclass(slots=True)
class StageBatch:
    """What one stage forward needs; built once per step and passed down the stage chain."""

    request_ids: list[str]
    num_new_tokens: list[int]
    """Tokens per request in this step (flattened in request order)."""
    positions: torch.Tensor  # [num_tokens] int64, absolute RoPE positions
    tree_masks: list[torch.Tensor | None]
    """Per request: [n_i, n_i] bool ancestor mask of its tree, or None for a causal chain
    (with ``extend``: [n_i, speculative slots + n_i])."""
    logit_indices: torch.Tensor | None = None  # [num_logits] rows that need logits; None = all
    token_ids: torch.Tensor | None = None  # [num_tokens] int64, used by the first stage
    extend: bool = False
    """Append the new tokens to the speculative level instead of replacing it (PipeDec's
    layer-by-layer tree: the masks then also cover the slots already there)."""

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


def query_length_order(num_new_tokens: Sequence[int]) -> list[int] | None:
    """Request order that puts the requests of each attention group (``attention.query_bucket``)
    next to each other, or None when they already are. On CPU a group whose rows are one slice
    of the flat batch needs no per-layer gather and scatter of its queries and outputs: one
    permutation of the hidden rows before the layers and one after replace 2 x layers of them."""
    keys = [query_bucket(n) for n in num_new_tokens]
    if all(a <= b for a, b in zip(keys, keys[1:])):
        return None
    return sorted(range(len(keys)), key=keys.__getitem__)


def _rows_in_order(counts: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Flat token rows of the requests taken in ``order``."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return torch.tensor([r for i in order for r in range(starts[i], starts[i] + counts[i])], dtype=torch.long)


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


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of RoPE at ``positions`` [T]  # each [T, 1, head_dim], for ``_apply_rope``"""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin, half = emb.sin(), inv_freq.shape[0]
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return emb.cos().to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x  # [T, heads, head_dim] rotated: transformers' ``x * cos + rotate_half(x) * sin``, bit for
    bit (``rotate_half(x) * sin == roll(x, head_dim / 2) * [-sin, sin]``: a sign flip is exact), in
    four ops instead of seven; the engine rotates q and k together, in one call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(slots=True)
class _StepAttention:
    """``attend`` over one step's plan, as ``LlamaStage._layers`` calls it for each layer. A fused
    stage reads the plan itself and runs its layers and their attention in one C call
    (``kernels.FusedStack``) where the plan lists every row's keys."""

    plan: AttentionPlan
    kv_cache: KVCache
    scale: float
    wide: bool

    def __call__(self, local: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(self.plan, self.kv_cache, local, q, k, v, scale=self.scale, wide=self.wide)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection  # [hidden] -> [(num_heads + 2 * num_kv_heads) * head_dim]
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection  # [hidden] -> [2 * intermediate]
    down: Projection


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
            """A dense tensor (a GGUF matrix asked for densely is dequantized)."""
            return as_dense(state_dict[name]).to(device=self.device, dtype=dtype).contiguous()

        def linear(names: Sequence[str], bias: torch.Tensor | None = None) -> Projection:
            return projection([state_dict[n] for n in names], bias, dtype=dtype, device=self.device)

        embed_name = "model.embed_tokens.weight"
        self.embed_weight: torch.Tensor | None = None
        self.embed_quant: QuantEmbedding | None = None
        """The input embedding: a dense matrix, or GGUF rows dequantized per lookup."""
        if self.is_first:
            if is_quantized(state_dict[embed_name]):
                self.embed_quant = QuantEmbedding(state_dict[embed_name], dtype=dtype, device=self.device)
            else:
                self.embed_weight = get(embed_name)
        self.layers: list[_Layer] = []
        for i in range(layer_start, layer_end):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            qkv_bias = torch.cat([get(f"{a}.bias") for a in attn]) if config.attention_bias else None
            gate_up_bias = down_bias = None
            if config.mlp_bias:
                gate_up_bias = torch.cat([get(f"{p}mlp.gate_proj.bias"), get(f"{p}mlp.up_proj.bias")])
                down_bias = get(f"{p}mlp.down_proj.bias")
            self.layers.append(_Layer(
                input_norm=get(f"{p}input_layernorm.weight"),
                qkv=linear([f"{a}.weight" for a in attn], qkv_bias),
                o=linear([f"{p}self_attn.o_proj.weight"]),
                post_norm=get(f"{p}post_attention_layernorm.weight"),
                gate_up=linear([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"], gate_up_bias),
                down=linear([f"{p}mlp.down_proj.weight"], down_bias),
            ))
        self.fused = self._fused_layers()
        """``kernels.FusedLayer`` per layer where every projection runs on our CPU kernels (fp32
        activations), else None: ``_layers`` then runs each layer's small operations in C."""
        self.fused_stack = None if self.fused is None else kernels.FusedStack(
            self.fused, config.num_heads, config.num_kv_heads, config.head_dim)
        """The same layers run by one C call a step, attention included (``forward``'s steps)."""
        self.wide_attention = self.device.type == "cpu" and any(
            bf16_activations(m) for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        """Attention in float64 (``models.attention._sdpa``): on CPU where bf16 roundings follow it
        (PyTorch's int4 kernels' activations), so that a row's logits do not depend on its batch.
        Our own kernel (``kernels.qgemm``) rounds each row alone (8 bits a group of 32) and a
        fused stage attends every row alone (``kernels.attend_rows``), so its rows are
        batch-invariant in fp32."""
        self.norm_weight = get("model.norm.weight") if self.is_last else None
        self.lm_head: Projection | None = None
        """[hidden] -> [vocab]; with tied embeddings over the embedding matrix."""
        if self.is_last:
            head = "lm_head.weight" if "lm_head.weight" in state_dict else embed_name  # tied embeddings
            if self.embed_weight is not None and head == embed_name:
                self.lm_head = DenseLinear(self.embed_weight)
            else:
                self.lm_head = linear([head])
        self.inv_freq = _rope_inv_freq(config).to(self.device)
        self.attention_scale = config.head_dim ** -0.5

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def new_kv_cache(self, budget_bytes: int | None = None, **kwargs) -> KVCache:
        """A KV pool for this slice: of ``budget_bytes``, allocated now (``KVCache.for_budget``),
        or, without one, growing as needed."""
        shape = (self.num_layers, self.config.num_kv_heads, self.config.head_dim)
        if budget_bytes is not None:
            kwargs.pop("max_blocks", None)
            return KVCache.for_budget(*shape, budget_bytes, dtype=self.dtype, device=self.device, **kwargs)
        return KVCache(*shape, dtype=self.dtype, device=self.device, **kwargs)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids  # [n] -> [n, hidden] with the target's input embedding H(·) (eq. 1)."""
        weight = self.embed_weight
        if self.embed_quant is not None:
            return self.embed_quant(token_ids)
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

        # once per step: cache slots, gather indices and masks for every request (models.attention)
        order = query_length_order(batch.num_new_tokens) if self.device.type == "cpu" else None
        rids, counts, masks, positions = batch.request_ids, batch.num_new_tokens, batch.tree_masks, batch.positions
        if order is not None:  # rows grouped by query length: each attention group is a slice
            rows = _rows_in_order(counts, order)
            rids, counts, masks = ([seq[i] for i in order] for seq in (rids, counts, masks))
            x, positions = x.index_select(0, rows), positions.index_select(0, rows)  # CPU only: no copies
        plan = plan_attention(rids, counts, masks, kv_cache, extend=batch.extend, device=self.device,
                              row_keys=self.fused is not None)
        with eager_attention(self.device):
            x = self._layers(x, positions.to(self.device),
                             _StepAttention(plan, kv_cache, self.attention_scale, self.wide_attention))
        if order is not None:
            x = torch.empty_like(x).index_copy_(0, rows, x)
        if not self.is_last:
            return x
        if batch.logit_indices is not None:
            x = x[batch.logit_indices.to(self.device)]
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm and lm_head, fp32 logits  # [rows, vocab]"""
        return self.lm_head(_rms_norm(x, self.norm_weight, self.config.rms_norm_eps)).float()

    def _fused_layers(self) -> "list[kernels.FusedLayer] | None":
        cfg = self.config
        if not kernels.fused_on(self.device, self.dtype) or cfg.head_dim > kernels.MAX_HEAD_DIM or not self.layers:
            return None
        fused = []
        for layer in self.layers:
            parts = {name: kernel_operand(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")}
            if any(p is None for p in parts.values()):
                return None
            fused.append(kernels.FusedLayer(layer.input_norm, layer.post_norm, cfg.rms_norm_eps, parts))
        return fused

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """The decoder layers over x  # [T, hidden] at RoPE ``positions`` [T];
        ``attention(local_layer, q, k, v) -> [T, heads * head_dim]`` writes and reads the KV."""
        cfg = self.config
        cos, signed_sin = _rope_tables(positions, self.inv_freq, self.dtype)
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.fused is not None:
            return self._fused_forward(x, cos, signed_sin, attention)
        for local, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            qk = qkv[:, :(nh + nkv) * hd].view(-1, nh + nkv, hd)  # q and k rotated together
            qk = _apply_rope(qk, cos, signed_sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * hd:].view(-1, nkv, hd)
            x = x + layer.o(attention(local, q, k, v))
            h = _rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x

    def _fused_forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                       attention) -> torch.Tensor:
        """``_layers`` with each layer's norms, RoPE, residuals and MLP activation in C
        (``kernels.FusedLayer``): for a step's row-keys plan every layer and its attention in one
        call (``kernels.FusedStack``), otherwise one call a layer around ``attention``."""
        cfg = self.config
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = x.to(torch.float32, copy=True).contiguous()  # updated in place: never the caller's tensor
        rows = x.shape[0]
        cos, signed_sin = cos.reshape(rows, hd).contiguous(), signed_sin.reshape(rows, hd).contiguous()
        scratch = kernels.LayerScratch(rows, cfg.hidden_size, (nh + 2 * nkv) * hd, cfg.intermediate_size, nh * hd)
        if self.fused_stack is not None and isinstance(attention, _StepAttention) \
                and attention.plan.row_keys is not None:  # every layer in one C call
            self.fused_stack(x, cos, signed_sin, attention.plan.row_keys, attention.plan.slot_mapping,
                             attention.kv_cache.pool, attention.scale, scratch)
            return x
        for local, layer in enumerate(self.fused):
            qkv = layer.pre(x, cos, signed_sin, nh + nkv, hd, scratch)
            q = qkv[:, :nh * hd].view(rows, nh, hd)
            k = qkv[:, nh * hd:(nh + nkv) * hd].view(rows, nkv, hd)
            v = qkv[:, (nh + nkv) * hd:].view(rows, nkv, hd)
            layer.post(x, attention(local, q, k, v).contiguous(), scratch)
        return x

    def forward_padded(self, inputs: "PaddedInputs", kv_cache: KVCache,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The fixed-shape step of ``models.runner``: B request rows × n query rows over L
        logical slots, every index and mask built here on the device from the block tables
        (nothing read back to the host, so the whole call can be captured in a CUDA graph).
        Returns hidden states [B * n, hidden] or, on the last stage, fp32 logits [B * n, vocab]
        of every padded row (with ``inputs.logit_rows``: [R, vocab] of those rows)."""
        x = self.embed(inputs.tokens) if self.is_first else hidden
        plan = padded_plan(inputs, kv_cache)
        x = self._layers(x, inputs.positions,
                         lambda local, q, k, v: attend_padded(plan, kv_cache, local, q, k, v,
                                                              scale=self.attention_scale, wide=self.wide_attention))
        if not self.is_last:
            return x
        return self.head(x if inputs.logit_rows is None else x.index_select(0, inputs.logit_rows))
