"""fp32 projections on the kernels (``gemm.c``): weights packed in 32-column blocks.

A weight [N, K] is kept as ``[ceil(N / 32)][K][32]`` (``pack``), so that at one row every block
is one contiguous stream, and every output is summed over k in one fixed order whatever the
number of rows: a row's result is the same alone or in any batch.
"""

from __future__ import annotations

import ctypes

import torch

from cosine_ray.models.kernels.build import library

BLOCK = 32
"""Output columns per weight block (two 16-lane registers)."""


def blocks(t: torch.Tensor) -> torch.Tensor:
    """t  # [N, ...] -> [ceil(N / 32), ..., 32], rows past N zero."""
    n = t.shape[0]
    padded = torch.zeros((-(-n // BLOCK) * BLOCK, *t.shape[1:]), dtype=t.dtype)
    padded[:n] = t
    return padded.view(-1, BLOCK, *t.shape[1:]).movedim(1, -1).contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight  # [N, K] -> [ceil(N / 32), K, 32] fp32, rows past N zero."""
    return blocks(weight.to(torch.float32))


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack``: [N, K]."""
    n_blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(n_blocks * BLOCK, k)[:out_features]


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias  # [N] -> [ceil(N / 32) * 32] fp32, zero past N (the kernels read whole blocks)."""
    return blocks(bias.to(torch.float32)).reshape(-1)


def call_parts(lib: ctypes.CDLL | None, x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x  # [..., k] as rows with unit column stride, and their output [rows, n]."""
    assert lib is not None, "a CPU kernel called where the library is not available"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, torch.empty(rows.shape[0], n, dtype=torch.float32)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None, *,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x  # [..., K] fp32 -> [..., N] with ``packed`` from ``pack`` and ``bias`` from ``pad_bias``;
    lib: a library other than this machine's (the tests pass copies built with other flags)."""
    lib = library() if lib is None else lib
    k = packed.shape[1]
    rows, y = call_parts(lib, x, k, out_features)
    lib.cr_linear_f32(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                      rows.shape[0], out_features, k, torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)
