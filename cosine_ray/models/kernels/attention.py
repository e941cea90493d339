"""The attention of a step's query rows over the KV pool (``attention.c``): ``attend_rows``.

Each row is computed in one fixed arithmetic over its own list of pool slots, in logical order,
in blocked tiles (a tile of query rows against a tile of keys) that never change a row's bits,
so a request gets the same bits however its prompt was chunked, cached or batched.
"""

from __future__ import annotations

import torch

from cosine_ray.models.kernels.build import library

TILE_VECTORS = 24
"""``cr_attend_rows`` attends up to this many query vectors (rows of one key list times the heads
of one KV head, at least one row's) together (``attention.c``)."""


def scores_buffer(row_keys, threads: int, group: int) -> torch.Tensor:
    """``cr_attend_rows``' score buffer for ``row_keys`` (``models.attention.RowKeys``) with
    ``group`` query heads a KV head, made once a step and kept there for every layer."""
    scores, rows = row_keys.scores, threads * max(TILE_VECTORS, group)
    if scores is None or scores.shape[0] != rows:
        scores = row_keys.scores = torch.empty(rows, (max(row_keys.max_keys, 1) + 15) // 16 * 16)
    return scores


def attend_rows(q: torch.Tensor, row_keys, kpool: torch.Tensor, vpool: torch.Tensor, scale: float,
                out: torch.Tensor, new: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None) -> None:
    """``cr_attend_rows``: the rows ``row_keys.rows`` of out  # [T, heads * head_dim] from q  # [T,
    heads, head_dim] (rows of any stride, heads packed) over the pool slots ``row_keys``
    (``models.attention.RowKeys``) of kpool, vpool  # [slots, kv_heads, head_dim] contiguous, fp32.
    ``new``: the step's (k, v  # [n, kv_heads, head_dim], rows of any stride, heads packed; slots
    [n] int64), written to the pool first in the same call."""
    _, heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous() and kpool.is_contiguous()
    rows, threads = row_keys.rows, torch.get_num_threads()
    scores = scores_buffer(row_keys, threads, heads // kpool.shape[1])
    k = v = slots = None
    n_new = 0
    if new is not None:
        k, v, slots = new
        n_new = len(slots)
        assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim and k.shape[0] == n_new
        assert slots.dtype == torch.int64 and slots.is_contiguous() and k.shape[1] == kpool.shape[1]
    library().cr_attend_rows(q.data_ptr(), q.stride(0), rows.data_ptr(), len(rows), row_keys.start.data_ptr(),
                             row_keys.count.data_ptr(), row_keys.keys.data_ptr(), kpool.data_ptr(), vpool.data_ptr(),
                             heads, kpool.shape[1], head_dim, scale, out.data_ptr(), out.stride(0), scores.data_ptr(),
                             scores.shape[1], threads, k.data_ptr() if n_new else None, k.stride(0) if n_new else 0,
                             v.data_ptr() if n_new else None, v.stride(0) if n_new else 0, n_new,
                             slots.data_ptr() if n_new else None)
