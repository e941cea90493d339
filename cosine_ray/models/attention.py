"""Attention of one varlen step over the paged KV pool (``models.kv_cache``).

A step mixes requests with a few new tokens (decodes, token trees, PipeDec layers) and long
chains (prefills and their chunks). ``plan_attention`` runs once per step, before the layer
loop, and builds on the host (copied to the device once) what the layers need:

- ``slot_mapping`` [T]: the pool slot of every new token (one scatter per layer);
- *batched groups* for requests with at most ``BATCHED_MAX_NEW`` new tokens: a gather index
  [B, L_max] of each request's pool slots, the padded query rows and one bool mask
  [B, 1, n_max, L_max] (committed slots, the tree's ancestor bits, padding hidden); per layer
  one gather and one ``scaled_dot_product_attention`` call. On CPU one group per power-of-two
  bucket of new-token counts (a padded call costs what its padded queries cost), the step's
  rows sorted by bucket once so each group is a slice; on CUDA one group for all;
- a *single* for each longer chain: a fresh prefill attends causally to itself, a continued
  one (a later chunk) gathers its slots and uses a causal-offset mask.

A fused fp32 CPU stage sends every row, prefills included, to ``kernels.attend_rows`` instead
(``RowKeys``): each row computed alone over its keys in logical order, so a request gives the same
bits however its prompt was chunked, cached or batched (docs/performance-cpu.md).
``padded_plan`` builds the same masks inside a CUDA graph (``models.runner``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosine_ray.models import kernels
from cosine_ray.models.kv_cache import KVCache

EAGER_CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""Attention kernels an eager CUDA forward may use: all but cuDNN's. In half precision on Hopper
PyTorch tries cuDNN attention first, and cuDNN builds an execution plan for every new shape on
the host, which costs far more than the kernel: an eager step's shapes change with every prompt
length and context. A captured graph (``models.runner``) builds its plans once, at capture, so
the graph path keeps PyTorch's choice."""


def eager_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The context an eager forward on ``device`` runs its attention calls in (on CUDA:
    ``EAGER_CUDA_BACKENDS``; elsewhere PyTorch's own choice)."""
    return sdpa_kernel(list(EAGER_CUDA_BACKENDS)) if device.type == "cuda" else contextlib.nullcontext()


BATCHED_MAX_NEW = 32
"""Requests with at most this many new tokens share the batched call; longer chains (prefills)
go alone, so one long prompt does not pad every short request's queries to its length."""


@dataclass(slots=True)
class _Batched:
    size: int
    """Requests in the group (B)."""
    max_new: int
    """n_max: query rows per request after padding."""
    gather_index: torch.Tensor | None
    """[B, L_max] pool slots of each request's logical slots (padding: slot 0, masked); None
    with a ``span``."""
    mask: torch.Tensor | None
    """[B, 1, n_max, L_max] bool, True = attend; None when every query sees every slot."""
    query_rows: torch.Tensor | None
    """[B * n_max] rows of the flat batch per padded query (padding repeats a real row);
    None when the group is the whole batch in order with no padding."""
    out_rows: torch.Tensor | None
    """[num real queries] flat rows the real queries' outputs go to."""
    real: torch.Tensor | None
    """[num real queries] their positions among the padded rows; None = all of them."""
    span: tuple[int, int] | None = None
    """One request whose slots are consecutive in the pool (its blocks were handed out in
    order): (its first slot, its length), read as a view instead of a gather."""
    rows: tuple[int, int] | None = None
    """The group's queries are the flat rows [start, stop) in order, unpadded: read and written
    as slices (with ``query_rows`` and ``out_rows`` None)."""


@dataclass(slots=True)
class _Single:
    offset: int
    num_new: int
    gather_index: torch.Tensor | None
    """[L] pool slots of all its logical slots; None = a fresh chain (attends to itself)."""
    mask: torch.Tensor | None
    """[n, L] bool for a continued chain; None with a fresh one (causal)."""


@dataclass(slots=True)
class RowKeys:
    """A step's query rows as lists of the pool slots each attends to (CPU, for
    ``kernels.attend_rows``): row ``rows[r]`` of the flat batch sees ``keys[start[r]:start[r] +
    count[r]]``. The rows of a chain without a tree mask share one list (each sees a prefix of
    it), so a long prefill costs one list, not one per row."""

    rows: torch.Tensor
    """[R] int64"""
    start: torch.Tensor
    """[R] int64"""
    count: torch.Tensor
    """[R] int64"""
    keys: torch.Tensor
    """int64 pool slots, each list in logical order."""
    max_keys: int
    scores: torch.Tensor | None = None
    """The kernel's score buffer, made at the first layer and reused by the others."""


@dataclass(slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor
    """[T] pool slot of every new token, in flat batch order."""
    groups: list[_Batched | _Single]
    row_keys: RowKeys | None = None
    """On CPU: the batched groups' rows and their keys, for our own attention kernel (``attend``)."""


def _visible(slot: int, n: int, tree_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[n, slot + n] bool: what n new tokens at logical slots [slot, slot + n) see. A
    ``tree_mask`` [n, w] covers the last w slots (the new tokens, or with a PipeDec layer the
    whole speculative level and them); every earlier slot is committed and visible. None: all."""
    if tree_mask is None:
        if n == 1:
            return None
        tree_mask = torch.ones(n, n, dtype=torch.bool).tril_()
    width = tree_mask.shape[1]
    assert tree_mask.shape[0] == n and n <= width <= slot + n, f"tree mask {tuple(tree_mask.shape)} for {n} tokens"
    mask = torch.ones(n, slot + n, dtype=torch.bool)
    mask[:, slot + n - width:] = tree_mask
    return mask


def plan_attention(request_ids, num_new_tokens, tree_masks, kv_cache: KVCache, *, extend: bool,
                   device: torch.device, row_keys: bool = False) -> AttentionPlan:
    """Open every request's speculative level (``reserve``, or ``extend`` for a PipeDec layer)
    and build the step's attention inputs (see the module docstring); ``row_keys`` (CPU, fp32):
    every row's keys for ``kernels.attend_rows`` instead of groups."""
    slot_mapping: list[int] = []
    batched: list[tuple[int, int, int, torch.Tensor | None, list[int]]] = []  # offset, n, L, visible, slots
    rows: list[tuple[int, int, int, torch.Tensor | None, list[int]]] = []  # offset, n, slot, tree mask, slots
    groups: list[_Batched | _Single] = []
    offset = 0
    total = sum(num_new_tokens)
    for rid, n, tree_mask in zip(request_ids, num_new_tokens, tree_masks):
        slot = kv_cache.extend(rid, n) if extend else kv_cache.reserve(rid, n)
        length = slot + n
        new_slots = kv_cache.slots(rid, slot, length)
        slot_mapping += new_slots
        if row_keys:
            rows.append((offset, n, slot, tree_mask, kv_cache.slots(rid, 0, slot) + new_slots))
        elif n <= BATCHED_MAX_NEW:
            batched.append((offset, n, length, _visible(slot, n, tree_mask), kv_cache.slots(rid, 0, slot) + new_slots))
        elif slot == 0 and tree_mask is None:
            groups.append(_Single(offset, n, None, None))
        else:
            index = torch.tensor(kv_cache.slots(rid, 0, length), dtype=torch.long, device=device)
            groups.append(_Single(offset, n, index, _visible(slot, n, tree_mask).to(device)))
        offset += n
    plan = AttentionPlan(torch.tensor(slot_mapping, dtype=torch.long, device=device), groups)
    if rows:
        plan.row_keys = _row_keys(rows)
    groups += [_batched_group(members, total, device) for members in _by_query_length(batched, device)]
    return plan


def _row_keys(members: list) -> RowKeys:
    rows, starts, counts, keys = [], [], [], []
    used = 0
    for offset, n, slot, tree_mask, slots in members:
        rows += range(offset, offset + n)
        slot_row = torch.tensor(slots, dtype=torch.long)
        if tree_mask is None:  # causal: row i sees the first slot + i + 1 slots of one list
            starts += [used] * n
            counts += range(slot + 1, slot + n + 1)
            keys.append(slot_row)
            used += len(slots)
            continue
        visible = _visible(slot, n, tree_mask)
        seen = visible.sum(1)
        starts += (used + seen.cumsum(0) - seen).tolist()
        counts += seen.tolist()
        keys.append(slot_row.expand(n, slot + n)[visible])
        used += int(seen.sum())
    return RowKeys(torch.tensor(rows, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                   torch.tensor(counts, dtype=torch.long), torch.cat(keys), max(counts))


def _by_query_length(batched: list, device: torch.device) -> list[list]:
    """The batched requests split by their new-token count into power-of-two buckets (1, 2,
    3-4, 5-8, ...) on CPU: one batched call per bucket, so one request's token tree does not
    pad every decoding request's queries to its length (figures: "Groups on CPU" above). On CUDA
    (where an extra call per layer costs launches, and most steps replay a padded graph) the
    batched requests stay one group."""
    if not batched:
        return []
    if device.type != "cpu":
        return [batched]
    buckets: dict[int, list] = {}
    for member in batched:
        buckets.setdefault(query_bucket(member[1]), []).append(member)
    return [buckets[k] for k in sorted(buckets)]


def query_bucket(num_new_tokens: int) -> int:
    """The CPU attention group of a request with this many new tokens: 0 for 1, 1 for 2, 2 for
    3-4, 3 for 5-8, ... (prefills longer than ``BATCHED_MAX_NEW`` go alone, last)."""
    return (num_new_tokens - 1).bit_length() if num_new_tokens <= BATCHED_MAX_NEW else BATCHED_MAX_NEW


def _batched_group(members, total: int, device: torch.device) -> _Batched:
    b = len(members)
    n_max = max(n for _, n, _, _, _ in members)
    l_max = max(length for _, _, length, _, _ in members)
    index = torch.zeros(b, l_max, dtype=torch.long)
    need_mask = any(vis is not None for *_, vis, _ in members) or any(length != l_max for _, _, length, _, _ in members)
    mask = torch.zeros(b, 1, n_max, l_max, dtype=torch.bool) if need_mask else None
    query_rows, out_rows, real = [], [], []
    for i, (offset, n, length, visible, slots) in enumerate(members):
        index[i, :length] = torch.tensor(slots, dtype=torch.long)
        if mask is not None:
            if visible is None:
                mask[i, 0, :n, :length] = True
            else:
                mask[i, 0, :n, :length] = visible
            mask[i, 0, n:, :] = True  # padded queries: anything, so no row is all -inf (outputs dropped)
        query_rows += list(range(offset, offset + n)) + [offset] * (n_max - n)
        out_rows += range(offset, offset + n)
        real += range(i * n_max, i * n_max + n)
    padded = len(real) != b * n_max
    start, stop = query_rows[0], query_rows[0] + len(query_rows)
    in_order = not padded and query_rows == list(range(start, stop))  # a slice of the flat batch
    rows = (start, stop) if in_order and stop - start != total else None
    slots = members[0][4]
    if b == 1 and in_order and _ascending(slots):
        return _Batched(1, n_max, None, None if mask is None else mask.to(device), None, None, None,
                        span=(slots[0], len(slots)), rows=rows)
    return _Batched(
        b, n_max, index.to(device), None if mask is None else mask.to(device),
        None if in_order else torch.tensor(query_rows, dtype=torch.long, device=device),
        None if in_order else torch.tensor(out_rows, dtype=torch.long, device=device),
        torch.tensor(real, dtype=torch.long, device=device) if padded else None, rows=rows)


def _ascending(slots: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


def _sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, wide: bool, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; ``wide``: in float64, cast back, so that a row's result
    does not depend on the shapes it is computed in. The CPU kernel splits its sums by the
    call's query and key lengths, so a row of a tree verify (padded keys, several queries) and
    the same row of a one-token step differ in the last bit of fp32, and a bf16 rounding
    downstream (the int4 kernels' activations of ``--weights native``) can turn that bit into
    another token at a near-tie. In float64 both sums round to the same fp32 value (a difference
    would need one within ~1e-16 of a rounding boundary): speculative and batched decoding then
    give exactly the plain decode's text on that path. ``LlamaStage.wide_attention`` says where."""
    if not wide:
        return F.scaled_dot_product_attention(query, keys, values, **kwargs)
    return F.scaled_dot_product_attention(query.double(), keys.double(), values.double(), **kwargs).to(query.dtype)


def attend(plan: AttentionPlan, kv_cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           *, scale: float, wide: bool = False) -> torch.Tensor:
    """q  # [T, heads, head_dim]; k, v  # [T, kv_heads, head_dim] -> [T, heads * head_dim].
    Writes k and v into the pool first."""
    num_tokens, heads, head_dim = q.shape
    gqa = k.shape[1] != heads
    if plan.row_keys is not None:  # our CPU kernel, every row (the plan holds no groups then)
        assert not wide and q.dtype == kv_cache.dtype == torch.float32, "row keys are for fp32 CPU stages"
        pools = kv_cache.span(layer, 0, kv_cache.pool.shape[2])
        out = q.new_empty(num_tokens, heads * head_dim)
        kernels.attend_rows(q, plan.row_keys, *pools, scale, out, new=(k, v, plan.slot_mapping))
        return out
    kv_cache.write_slots(layer, plan.slot_mapping, k, v)
    if len(plan.groups) == 1 and isinstance(plan.groups[0], _Batched) and plan.groups[0].query_rows is None \
            and plan.groups[0].rows is None:
        return _attend_batched(plan.groups[0], kv_cache, layer, q, scale, gqa, wide)  # the common case: no scatter
    out = q.new_empty(num_tokens, heads * head_dim)
    for g in plan.groups:
        if isinstance(g, _Batched):
            if g.rows is not None:
                start, stop = g.rows
                out[start:stop] = _attend_batched(g, kv_cache, layer, q[start:stop], scale, gqa, wide)
                continue
            rows = _attend_batched(g, kv_cache, layer, q.index_select(0, g.query_rows), scale, gqa, wide)
            if g.real is not None:
                rows = rows.index_select(0, g.real)
            out.index_copy_(0, g.out_rows, rows)
            continue
        _attend_single(g, kv_cache, layer, q, k, v, scale, gqa, wide, out)
    return out


def _attend_single(g: _Single, kv_cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float, gqa: bool, wide: bool, out: torch.Tensor) -> None:
    """A long chain's rows of ``out``."""
    _, heads, head_dim = q.shape
    n, sl = g.num_new, slice(g.offset, g.offset + g.num_new)
    query = q[sl].transpose(0, 1)[None]
    if g.gather_index is None:  # a fresh chain: its own keys, causal
        keys, values = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
        o = _sdpa(query, keys, values, wide, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        keys, values = kv_cache.gather(layer, g.gather_index)
        o = _sdpa(query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], wide,
                  attn_mask=g.mask, scale=scale, enable_gqa=gqa)
    out[sl] = o[0].transpose(0, 1).reshape(n, heads * head_dim)


def _attend_batched(g: _Batched, kv_cache: KVCache, layer: int, q: torch.Tensor, scale: float,
                    gqa: bool, wide: bool = False) -> torch.Tensor:
    """q  # [B * n_max, heads, head_dim] (padded rows) -> [B * n_max, heads * head_dim]"""
    _, heads, head_dim = q.shape
    if g.span is not None:
        keys, values = (t[None] for t in kv_cache.span(layer, *g.span))
    else:
        keys, values = kv_cache.gather(layer, g.gather_index)  # [B, L, kv, hd]
    query = q.view(g.size, g.max_new, heads, head_dim).transpose(1, 2)
    o = _sdpa(query, keys.transpose(1, 2), values.transpose(1, 2), wide, attn_mask=g.mask,
              scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2).reshape(g.size * g.max_new, heads * head_dim)


# ---- the fixed-shape step (models.runner) -------------------------------------------------------

@dataclass(slots=True)
class PaddedInputs:
    """A step laid out as B request rows × n query rows over L logical slots, the shape of one
    CUDA graph (``models.runner``). Every tensor lives on the device at a fixed address; the
    runner refills them each step with one host→device copy. Padding: a request row with
    ``count`` 0, query rows past ``count``, block-table entries past a request's blocks: all point
    at the pool's scratch block, so they write and read nothing a real request owns."""

    tokens: torch.Tensor
    """[B * n] int64 token ids (first stage)."""
    positions: torch.Tensor
    """[B * n] int64 RoPE positions."""
    start: torch.Tensor
    """[B] int64: each request's first new logical slot (its committed length)."""
    count: torch.Tensor
    """[B] int64: its new tokens (0 = a padding row)."""
    tables: torch.Tensor
    """[B, L / block_size] int64 block table (padding: the scratch block)."""
    ancestors: torch.Tensor | None
    """[B, n, n] int64 0/1: query i sees new token j (a tree's ancestor bits, a chain's
    causal triangle; a padded query row sees itself only). None: every row is a causal chain
    (a prefill bucket, where n is too large for a dense [B, n, n] copy; query i sees new
    tokens 0..i, a padded row real ones too, whose outputs are dropped)."""
    scratch_slot: torch.Tensor
    """[] int64: first slot of the scratch block."""
    logit_rows: torch.Tensor | None = None
    """[R] int64 padded rows the last stage computes logits for (a prefill bucket: one per
    request row, its prompt's last token); None: every row (a verify tree needs them all)."""

    @property
    def shape(self) -> tuple[int, int, int]:
        b = int(self.start.shape[0])
        return b, int(self.positions.shape[0]) // b, int(self.tables.shape[1])


@dataclass(slots=True)
class PaddedPlan:
    size: int
    max_new: int
    slot_mapping: torch.Tensor
    """[B * n] pool slot each query row's keys and values go to (padding: scratch)."""
    gather_index: torch.Tensor
    """[B, L] pool slot of each logical slot."""
    mask: torch.Tensor
    """[B, 1, n, L] bool, True = attend."""


def padded_plan(inputs: PaddedInputs, kv_cache: KVCache) -> PaddedPlan:
    """Slot mapping, gather index and mask of a fixed-shape step, built on the device from the
    block tables (vLLM computes its slot mapping the same way): no host work, no host sync."""
    b, n, _ = inputs.shape
    bs = kv_cache.block_size
    device = inputs.tables.device
    num_slots = inputs.tables.shape[1] * bs
    logical = torch.arange(num_slots, device=device)
    gather_index = inputs.tables[:, logical // bs] * bs + logical % bs  # [B, L]
    j = torch.arange(n, device=device)
    new_logical = (inputs.start[:, None] + j[None, :]).clamp_(max=num_slots - 1)  # [B, n]
    real = j[None, :] < inputs.count[:, None]
    slot_mapping = torch.where(real, gather_index.gather(1, new_logical), inputs.scratch_slot)
    rel = logical[None, :] - inputs.start[:, None]  # [B, L]: column's index among the new tokens
    in_new = (rel >= 0) & (rel < n)
    if inputs.ancestors is None:  # causal chains
        tree = rel[:, None, :] <= j[None, :, None]
    else:
        tree = inputs.ancestors.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, num_slots)) != 0
    mask = (rel < 0)[:, None, :] | (tree & in_new[:, None, :])  # committed slots, then tree bits
    return PaddedPlan(b, n, slot_mapping.reshape(-1), gather_index, mask[:, None])


def attend_padded(plan: PaddedPlan, kv_cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, *, scale: float, wide: bool = False) -> torch.Tensor:
    """q  # [B * n, heads, head_dim]; k, v  # [B * n, kv_heads, head_dim] -> [B * n, heads * head_dim]:
    one scatter of the new keys and values, one gather, one attention call."""
    kv_cache.write_slots(layer, plan.slot_mapping, k, v)
    g = _Batched(plan.size, plan.max_new, plan.gather_index, plan.mask, None, None, None)
    return _attend_batched(g, kv_cache, layer, q, scale, k.shape[1] != q.shape[1], wide)
