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
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from cosine_ray.models import kernels
from cosine_ray.models.config import ModelConfig
from cosine_ray.models.attention import (AttentionPlan, PaddedInputs, attend, attend_padded, eager_attention,
                                         padded_plan, plan_attention, query_bucket)
from cosine_ray.models.kv_cache import KVCache
from cosine_ray.models.quant import QuantEmbedding, QuantLinear, QuantTensor, is_quantized


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
    permutation of the hidden rows before the layers and one after replace 2 x layers of them
    (measured: 3 requests with 3-token trees among 13 decodes, attention of 30 layers 42 ms in
    batch order, see the CPU figures in ``attention``)."""
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


CPU_GEMM_ENV = kernels.ENV
"""``blocked`` (default on CPU: our own kernels, ``models.kernels``, where they build; oneDNN for
half-precision weights), ``onednn`` or ``mkl``: the kernel of the CPU projections."""
CPU_GEMM_KERNELS = kernels.KERNELS
FUSED_ENV = kernels.FUSED_ENV


def onednn_available() -> bool:
    """This PyTorch build can pre-pack and run oneDNN linear layers on CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def projection_kernel(device: torch.device | str) -> str:
    """The kernel of the fp32 projections stages built now on ``device`` use: ``blocked``,
    ``onednn`` or ``mkl`` on CPU (``COSINE_RAY_CPU_GEMM``; half-precision weights go to oneDNN
    under ``blocked``, and a dtype oneDNN cannot pack on this CPU to MKL, per weight),
    ``default`` elsewhere (``x @ w_t``)."""
    device = torch.device(device)
    if device.type != "cpu":
        return "default"
    if _use_blocked(device, torch.float32):
        return "blocked"
    return "onednn" if _use_onednn(device) else "mkl"


def _native_half_gemm(dtype: torch.dtype) -> bool:
    """This CPU has a native GEMM for ``dtype`` (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16 or AMX)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _use_blocked(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and kernels.used_on(device)


def _use_onednn(device: torch.device) -> bool:
    return kernels.choice() in ("blocked", "onednn") and device.type == "cpu" and onednn_available()


class _Linear:
    """One projection, ``y = x W^T + b``, with the kernel chosen once at load time.

    An fp32 weight on CPU goes, by default, to our own kernel (``models.kernels``: 32-column
    blocks, one contiguous stream each at one row, every output summed in one order whatever
    the rows): on our 2-core AMD EPYC it applies the embedded model's layers at one row at
    about the memory bandwidth, where oneDNN's packed linear took ~1.7x that; whole verify
    forwards were faster with up to 5 new tokens per request and 2-8 % slower with 9-17 on
    several requests (docs/performance-cpu.md). Where it cannot be built
    (no C compiler), for half-precision weights, or with ``COSINE_RAY_CPU_GEMM=onednn``, the
    weight is pre-packed for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``, the layout
    PyTorch's own frozen CPU graphs use) and applied with ``_linear_pointwise``:
    no re-packing per call, and a JIT kernel for the CPU at hand. For the 1-17 rows of a
    verify step this is what makes extra draft tokens cheap: measured on our 2-core AMD EPYC
    (AVX2) with SmolLM2's gate/up shape, 2 threads, MKL ``x @ W^T`` 0.15 / 0.33 / 0.56 /
    0.73 ms at 1 / 2 / 5 / 9 rows vs oneDNN 0.12 / 0.12 / 0.25 / 0.35 ms (MKL picks slow code
    paths on non-Intel CPUs). Elsewhere (CUDA, or a dtype oneDNN cannot pack on this CPU,
    e.g. bf16 without AVX512-BF16/AVX-NE-CONVERT) the weight is stored transposed,
    ``[in, out]``, and applied as ``x @ w_t`` (on MKL 1.3-1.7x faster than ``F.linear`` for
    2-16 rows). ``COSINE_RAY_CPU_GEMM=mkl`` forces the second form (to compare).

    A half-precision weight on a CPU that cannot pack it (no native bf16/fp16 GEMM) is kept
    transposed *in fp32* and applied as ``(x.float() @ w_t).to(x.dtype)``: the exact fp32 values
    of the bf16 weights, accumulated in fp32 and rounded once, what a bf16 GEMM with fp32
    accumulation computes (up to summation order), at fp32 speed for twice bf16's weight memory. PyTorch's own bf16
    ``x @ w_t`` on such a CPU is a slow fallback: measured on our 2-core AMD EPYC (AVX2, 1
    thread), SmolLM2's 576 → 1536 shape, 1.6 / 12.3 / 93 / 403 ms at 1 / 8 / 64 / 256 rows
    against 0.10 / 0.46 / 1.8 / 6.2 ms in fp32 (``F.linear`` in bf16: 0.24 / 2.6 / 13 / 54 ms;
    the fp32 form: 0.41 / 0.57 / 4.8 / 8.0 ms): a bf16 test ran 25 minutes without finishing."""

    __slots__ = ("blocked", "blocked_bias", "packed", "w_t", "bias", "out_features", "upcast")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight  # [out, in] (the checkpoint's layout)"""
        self.bias = bias
        self.out_features = int(weight.shape[0])
        self.blocked: torch.Tensor | None = None
        """fp32 on CPU: [out / 32, in, 32] for ``models.kernels`` (the default kernel there)."""
        self.blocked_bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.w_t: torch.Tensor | None = None
        self.upcast = False
        if _use_blocked(weight.device, weight.dtype):
            self.blocked = kernels.pack(weight)
            self.blocked_bias = None if bias is None else kernels.pad_bias(bias)
            return
        if _use_onednn(weight.device):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError:  # dtype this CPU cannot pack
                self.packed = None
        self.upcast = (self.packed is None and weight.device.type == "cpu"
                       and weight.dtype in (torch.bfloat16, torch.float16) and not _native_half_gemm(weight.dtype))
        if self.packed is None:
            self.w_t = (weight.float() if self.upcast else weight).t().contiguous()

    def weight(self) -> torch.Tensor:
        """The weight as the checkpoint holds it, [out, in] (a copy where it is packed)."""
        if self.blocked is not None:
            return kernels.unpack(self.blocked, self.out_features)
        if self.w_t is not None:
            return self.w_t.t()
        eye = torch.eye(int(self.packed.shape[1]), dtype=self.packed.dtype)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            return kernels.linear(x, self.blocked, self.out_features, self.blocked_bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.upcast:
            y = x.float() @ self.w_t
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        if self.bias is None:
            return x @ self.w_t
        return torch.addmm(self.bias, x, self.w_t)


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
    qkv: "_Linear | QuantLinear"  # [hidden] -> [(num_heads + 2 * num_kv_heads) * head_dim]
    o: "_Linear | QuantLinear"
    post_norm: torch.Tensor
    gate_up: "_Linear | QuantLinear"  # [hidden] -> [2 * intermediate]
    down: "_Linear | QuantLinear"


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
            value = state_dict[name]
            if is_quantized(value):  # a norm or bias never is; a matrix asked for densely
                value = value.dequantize()
            return value.to(device=self.device, dtype=dtype).contiguous()

        def get_optional(name: str) -> torch.Tensor | None:
            return get(name) if name in state_dict else None

        def linear(names: Sequence[str], bias: torch.Tensor | None = None) -> "_Linear | QuantLinear":
            """One projection over the rows of ``names`` stacked: kept quantized where they all
            are, in one GGUF format (``models.quant``), dense otherwise."""
            parts = [state_dict[n] for n in names]
            if all(is_quantized(p) for p in parts) and len({p.fmt for p in parts}) == 1:
                return QuantLinear(QuantTensor.cat(parts), dtype=dtype, device=self.device, bias=bias)
            return _Linear(torch.cat([get(n) for n in names]), bias)

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
            isinstance(m, QuantLinear) and m.blocked is None
            for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        """Attention in float64 (``models.attention._sdpa``): on CPU where bf16 roundings follow it
        (PyTorch's int4 kernels' activations), so that a row's logits do not depend on its batch.
        Our own kernel (``models.kernels``) rounds each row alone (8 bits a group of 32) and a
        fused stage attends every row alone (``kernels.attend_rows``), so its rows are
        batch-invariant in fp32."""
        self.norm_weight = get("model.norm.weight") if self.is_last else None
        self.lm_head: _Linear | QuantLinear | None = None
        """[hidden] -> [vocab]; with tied embeddings over the embedding matrix."""
        if self.is_last:
            head = "lm_head.weight" if "lm_head.weight" in state_dict else embed_name  # tied embeddings
            if self.embed_weight is not None and head == embed_name:
                self.lm_head = _Linear(self.embed_weight)
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

        def projection(m: "_Linear | QuantLinear", n: int, k: int):
            return None if m.blocked is None else (m.blocked, m.blocked_bias, n, k)

        h, inter = cfg.hidden_size, cfg.intermediate_size
        qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        fused = []
        for layer in self.layers:
            parts = {"qkv": projection(layer.qkv, qkv_n, h), "o": projection(layer.o, h, cfg.num_heads * cfg.head_dim),
                     "gate_up": projection(layer.gate_up, 2 * inter, h), "down": projection(layer.down, h, inter)}
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
