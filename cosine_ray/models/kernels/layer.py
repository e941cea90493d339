"""A decoder layer's small operations beside its projections (``layer.c``): ``FusedLayer``.

Two calls a layer (``pre``: RMS norm, the qkv projection, RoPE; ``post``: the o projection, the
residual add, RMS norm, gate/up, SiLU · up, down, the residual add) instead of some thirty
PyTorch operations, each row computed alone as the projections compute it.
"""

from __future__ import annotations

import ctypes

import torch

from cosine_ray.models.kernels.build import Proj, library
from cosine_ray.models.kernels.qgemm import BlockedQuant, quant_scratch

MAX_HEAD_DIM = 1024
"""``cr_layer_pre`` rotates a head through a stack buffer of this many floats (``kernels.h``)."""


def proj(weight: "torch.Tensor | BlockedQuant", bias: torch.Tensor | None, n: int, k: int) -> Proj:
    """``cr_proj`` of one projection: fp32 blocks (``gemm.pack``) or GGUF blocks (``pack_quant``)."""
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weight, BlockedQuant):
        return Proj(1 + weight.kind, n, k, weight.codes.data_ptr(), weight.scales.data_ptr(),
                    None if weight.mins is None else weight.mins.data_ptr(),
                    None if weight.sub is None else weight.sub.data_ptr(), bias_ptr, None)
    return Proj(0, n, k, weight.data_ptr(), None, None, None, bias_ptr, None)


def chain(operand) -> list[Proj]:
    """A projection's ``cr_proj`` parts, linked in order: one for (weight, bias, N, K), one a part
    for a list of them (``models.linear.StackedLinear``)."""
    parts = [proj(*p) for p in (operand if isinstance(operand, list) else [operand])]
    for a, b in zip(parts, parts[1:]):
        a.next = ctypes.addressof(b)
    return parts


class LayerScratch:
    """The buffers one forward's layers share: [rows, hidden] twice, the qkv rows, gate/up and
    the activation, and the GGUF kernel's scratch (``quant_scratch``)."""

    __slots__ = ("h", "qkv", "gu", "act", "xsum")

    def __init__(self, rows: int, hidden: int, qkv: int, inter: int, attn: int) -> None:
        """attn: the o projection's input width (heads × head_dim, which need not be hidden)."""
        self.h = torch.empty(rows, hidden)
        self.qkv = torch.empty(rows, qkv)
        self.gu = torch.empty(rows, 2 * inter)
        self.act = torch.empty(rows, inter)
        self.xsum = quant_scratch(rows, max(hidden, inter, attn))  # any projection's K


class FusedLayer:
    """One decoder layer's norms, RoPE, residual adds and SiLU · up run in ``layer.c`` around its
    four projections (each either fp32 blocks from ``pack`` or GGUF blocks from ``pack_quant``).
    The tensors the projections point at stay alive in the caller's layer
    (``models.llama.LlamaStage.layers``)."""

    __slots__ = ("input_norm", "post_norm", "eps", "qkv", "o", "gate_up", "down", "hidden", "parts")

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, projections: dict) -> None:
        """projections: qkv, o, gate_up and down, each as (weight, padded bias or None, N, K), or
        a list of them for a projection in parts (``chain``)."""
        self.input_norm, self.post_norm, self.eps = input_norm.contiguous(), post_norm.contiguous(), float(eps)
        self.parts = {name: chain(projections[name]) for name in ("qkv", "o", "gate_up", "down")}
        self.qkv, self.o, self.gate_up, self.down = (ctypes.pointer(self.parts[name][0])
                                                     for name in ("qkv", "o", "gate_up", "down"))
        qkv = projections["qkv"]
        self.hidden = (qkv[0] if isinstance(qkv, list) else qkv)[3]

    def pre(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rot_heads: int, head_dim: int,
            scratch: LayerScratch) -> torch.Tensor:
        """x  # [rows, hidden] fp32 contiguous -> the rows' q, k, v [rows, qkv] (q and k rotated),
        in ``scratch``; cos, signed_sin  # [rows, head_dim] contiguous."""
        library().cr_layer_pre(x.data_ptr(), x.shape[0], self.hidden, self.input_norm.data_ptr(), self.eps, self.qkv,
                               cos.data_ptr(), signed_sin.data_ptr(), rot_heads, head_dim, scratch.h.data_ptr(),
                               scratch.qkv.data_ptr(), scratch.xsum.data_ptr(), torch.get_num_threads())
        return scratch.qkv

    def post(self, x: torch.Tensor, attn: torch.Tensor, scratch: LayerScratch) -> None:
        """x += the layer's attention output projected, then its MLP, in place; attn  # [rows, heads *
        head_dim] contiguous."""
        library().cr_layer_post(x.data_ptr(), x.shape[0], self.hidden, attn.data_ptr(), self.o,
                                self.post_norm.data_ptr(), self.eps, self.gate_up, self.down, scratch.h.data_ptr(),
                                scratch.gu.data_ptr(), scratch.act.data_ptr(), scratch.xsum.data_ptr(),
                                torch.get_num_threads())
