"""A stage's fused layers in one call a step (``stage.c``): ``FusedStack``."""

from __future__ import annotations

import torch

from cosine_ray.models.kernels.attention import scores_buffer
from cosine_ray.models.kernels.build import Layer, library
from cosine_ray.models.kernels.layer import FusedLayer, LayerScratch


class FusedStack:
    """A stage's ``FusedLayer`` list run by one ``cr_stage_layers`` call a step: each layer's
    ``pre``, ``attend_rows`` over the step's row keys and ``post``, in order, as the per-layer
    calls would run them (the same bits), without Python between the layers."""

    __slots__ = ("layers", "table", "eps", "heads", "kv_heads", "head_dim")

    def __init__(self, layers: "list[FusedLayer]", heads: int, kv_heads: int, head_dim: int) -> None:
        self.layers = layers  # keeps the projections' structs alive
        self.table = (Layer * len(layers))(*(
            Layer(l.input_norm.data_ptr(), l.post_norm.data_ptr(), l.qkv, l.o, l.gate_up, l.down) for l in layers))
        self.eps = layers[0].eps
        assert all(l.eps == self.eps for l in layers)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, row_keys,
                 slots: torch.Tensor, pool: torch.Tensor, scale: float, scratch: LayerScratch) -> None:
        """x  # [rows, hidden] fp32 contiguous, updated in place; cos, signed_sin  # [rows, head_dim]
        contiguous; row_keys (``models.attention.RowKeys``) naming every row; slots  # [rows] int64,
        each row's new pool slot; pool  # [layers, 2, slots, kv_heads, head_dim] fp32 contiguous
        (``KVCache.pool``)."""
        rows, threads = x.shape[0], torch.get_num_threads()
        assert x.is_contiguous() and pool.is_contiguous() and pool.dtype == torch.float32
        assert pool.shape[0] == len(self.layers) and pool.shape[3:] == (self.kv_heads, self.head_dim)
        assert len(slots) == rows == len(row_keys.rows) and slots.dtype == torch.int64 and slots.is_contiguous()
        scores = scores_buffer(row_keys, threads, self.heads // self.kv_heads)
        attn = torch.empty(rows, self.heads * self.head_dim)
        library().cr_stage_layers(
            x.data_ptr(), rows, x.shape[1], self.table, len(self.layers), self.eps, cos.data_ptr(),
            signed_sin.data_ptr(), self.heads, self.kv_heads, self.head_dim, scale, row_keys.rows.data_ptr(),
            len(row_keys.rows), row_keys.start.data_ptr(), row_keys.count.data_ptr(), row_keys.keys.data_ptr(),
            scores.shape[1], pool.data_ptr(), pool.shape[2], slots.data_ptr(), scratch.h.data_ptr(),
            scratch.qkv.data_ptr(), scratch.gu.data_ptr(), scratch.act.data_ptr(), attn.data_ptr(),
            scratch.xsum.data_ptr(), scores.data_ptr(), threads)
