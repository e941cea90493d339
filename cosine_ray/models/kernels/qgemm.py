"""GGUF projections kept quantized, on the kernels (``qgemm.c``).

``pack_quant`` lays a GGUF matrix's codes (``models.weights.quant``) out in the 32-column blocks of
``gemm`` (four k of a column to a 32-bit lane, for VNNI's integer dot products) with the file's
fp16 scales (per group, or the K formats' per superblock with their groups' 6- and 8-bit
scales); ``linear_quant`` multiplies them with the activations rounded to 8 bits a group of 32
(``round_rows``, as llama.cpp does for its legacy formats; its K formats round per 256). The
integer sums are exact, so a row's result is the same alone, in any batch, on any thread count
and on any instruction set.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cosine_ray.models.kernels.build import library
from cosine_ray.models.kernels.gemm import BLOCK, blocks, call_parts
from cosine_ray.models.weights.quant import GROUP

QUANT_KINDS = {"Q8_0": 0, "Q4_1": 1, "Q4_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
"""GGUF formats the kernel multiplies, as ``qgemm.c`` numbers them."""
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
"""Formats whose codes go two a byte (the others: one a byte)."""


@dataclass(frozen=True, slots=True)
class BlockedQuant:
    """A GGUF matrix [N, K] laid out for ``cr_linear_q`` (see ``qgemm.c``)."""

    codes: torch.Tensor
    """uint8 [N/32, K/2, 32] (``FOUR_BIT``: two codes a byte) or [N/32, K, 32], in the order
    ``qgemm.c`` gives."""
    kind: int
    """``qgemm.c``'s format: ``QUANT_KINDS[fmt]``."""
    scales: torch.Tensor
    """fp16 [N/32, K/32, 32]: d, the file's own; the K formats' [N/32, K/256, 32]."""
    mins: torch.Tensor | None
    """fp16 like ``scales``: m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K), or None."""
    out_features: int
    in_features: int
    sub: torch.Tensor | None = None
    """uint8 [N/32, K/32, 2, 32], the K formats' groups: sc and mn, or Q6_K's two int8 scales."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins, self.sub)
                   if t is not None)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """t  # [N, K/32] fp32 that came from fp16 -> [N/32, K/32, 32] fp16, the same values."""
    h = t.to(torch.float16)
    if not torch.equal(h.to(t.dtype), t):
        raise ValueError("GGUF scales must be fp16 values")
    return blocks(h)


def pack_quant(fmt: str, d: torch.Tensor, m: torch.Tensor | None, codes: torch.Tensor,
               sub: torch.Tensor | None = None) -> BlockedQuant:
    """A GGUF matrix in the kernel's blocks, from its fields (``QuantTensor._fields()``): scales
    and mins [N, K/32] (the file's fp16 values; the K formats' [N, K/256], with ``sub`` [N, K/32,
    2] their groups' bytes), codes [N, K] (int8 for Q8_0). The same weights, exactly. The codes
    go in the order ``qgemm.c`` describes: four consecutive k of a column in one 32-bit lane."""
    n, k = codes.shape
    cols = blocks(codes.view(torch.uint8)).movedim(-1, 1)  # [N/32, 32 n, K]
    nb, groups = cols.shape[0], k // GROUP
    kind, mins = QUANT_KINDS[fmt], None if m is None else _halves(m)
    packed_sub = None if sub is None else blocks(sub.contiguous()).contiguous()  # [N/32, K/32, 2, 32]
    if fmt not in FOUR_BIT:
        lanes = (cols ^ 0x80 if fmt == "Q8_0" else cols).reshape(nb, 2, 16, groups, 8, 4)  # [t, h, c, g, kk, j]
        laid = lanes.permute(0, 3, 1, 4, 2, 5).contiguous().view(nb, k, BLOCK)
        return BlockedQuant(laid, kind, _halves(d), mins, n, k, packed_sub)
    halves = cols.reshape(nb, 2, 16, groups, 4, 2, 4)  # [t, h, c, g, kk, low / high, j]
    pairs = halves[..., 0, :] | (halves[..., 1, :] << 4)
    laid = pairs.permute(0, 3, 1, 4, 2, 5).contiguous().view(nb, k // 2, BLOCK)
    return BlockedQuant(laid, kind, _halves(d), mins, n, k, packed_sub)


def quant_scratch(rows: int, k: int) -> torch.Tensor:
    """What ``cr_linear_q`` needs beside its operands for ``rows`` rows of width ``k``: the rows
    rounded to 8 bits, their scales and their group sums (11 floats a group)."""
    return torch.empty(max(rows, 1) * (k // GROUP) * 11, dtype=torch.float32)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x  # [M, K] fp32 as the GGUF kernel sees it: each group of 32 rounded to 8 bits with the
    scale max |x| / 127 (round half to even), back in fp32. ``linear_quant(x, w)`` is
    ``round_rows(x) @ w^T`` within fp32 rounding."""
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    s = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return (torch.round(g * inv) * s).reshape(x.shape)


def linear_quant(x: torch.Tensor, weight: BlockedQuant, bias: torch.Tensor | None = None, *,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x  # [..., K] fp32 -> [..., N] fp32 with ``weight`` from ``pack_quant`` and ``bias`` from
    ``pad_bias``; lib: a library other than this machine's (the tests pass copies built with
    other flags)."""
    lib = library() if lib is None else lib
    k, n = weight.in_features, weight.out_features
    rows, y = call_parts(lib, x, k, n)
    scratch = quant_scratch(rows.shape[0], k)
    lib.cr_linear_q(rows.data_ptr(), rows.stride(0), weight.codes.data_ptr(), weight.kind,
                    weight.scales.data_ptr(), None if weight.mins is None else weight.mins.data_ptr(),
                    None if weight.sub is None else weight.sub.data_ptr(), None if bias is None else bias.data_ptr(),
                    y.data_ptr(), n, rows.shape[0], n, k, scratch.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], n)
