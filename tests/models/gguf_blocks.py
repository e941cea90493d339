"""GGUF blocks for the tests: fp32 matrices quantized to every format ``models.weights.quant`` serves.
The ``gguf`` package quantizes the 32-weight formats (llama.cpp's reference code); for the K
formats, which it only dequantizes, a plain reference quantizer here (per group: the range to a
6-bit scale and min, or per 16 to an int8 scale) writes blocks in llama.cpp's byte layout. The
weights a block holds are what ``gguf``'s dequantizer says, whoever quantized it."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cosine_ray.models.weights.quant import K_FORMATS, QuantTensor


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """w  # [rows, cols] (cols a multiple of 256) -> [rows, cols / 256 * bytes] uint8"""
    sb = w.reshape(-1, 256).astype(np.float32)
    n = sb.shape[0]
    if fmt == "Q6_K":
        x = sb.reshape(n, 16, 16)
        scale = np.abs(x).max(-1) / 31.5  # [n, 16]
        d = _fp16(scale.max(-1) / 127)
        sc = np.clip(np.round(np.divide(scale, d.astype(np.float32)[:, None], out=np.zeros_like(scale),
                                        where=d[:, None] > 0)), -128, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
        q = np.clip(np.round(np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] != 0)) + 32,
                    0, 63).astype(np.uint8).reshape(n, 2, 4, 32)  # [h][s][l]: element 128 h + 32 s + l
        ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                            axis=-1)  # [n, 2, 64]: byte l holds elements 128 h + l and 128 h + 64 + l
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64).astype(np.uint8), sc.view(np.uint8),
                               d.reshape(n, 1).view(np.uint8)], axis=-1)
    levels = 15 if fmt == "Q4_K" else 31
    x = sb.reshape(n, 8, 32)
    low = np.maximum(-x.min(-1), 0)  # each group's min, as - dmin mn
    scale = (x.max(-1) + low) / levels
    d, dmin = _fp16(scale.max(-1) / 63), _fp16(low.max(-1) / 63)
    sc = np.clip(np.round(np.divide(scale, d.astype(np.float32)[:, None], out=np.zeros_like(scale),
                                    where=d[:, None] > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(low, dmin.astype(np.float32)[:, None], out=np.zeros_like(low),
                                    where=dmin[:, None] > 0)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round(np.divide(x + offset[..., None], step[..., None], out=np.zeros_like(x),
                                   where=step[..., None] > 0)), 0, levels).astype(np.uint8).reshape(n, 4, 2, 32)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1).astype(np.uint8)
    qs = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(n, 128)  # chunk j: elements 64 j + l, 64 j + 32 + l
    head = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales]
    if fmt == "Q5_K":
        bits = (q.reshape(n, 8, 32) >> 4) & 1  # bit i of qh[l]: element 32 i + l
        head.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8))
    return np.concatenate([*head, qs], axis=-1)


def quantize_blocks(w: np.ndarray, fmt: str) -> QuantTensor:
    """w  # [rows, cols] fp32 as GGUF blocks of ``fmt`` (``gguf``'s quantizer, or ours for the K formats)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if fmt in K_FORMATS:
        data = _k_blocks(w, fmt).reshape(w.shape[0], -1)
    else:
        data = quantize(w, GGMLQuantizationType[fmt])
    return QuantTensor(fmt, torch.from_numpy(np.ascontiguousarray(data)), w.shape[1])
