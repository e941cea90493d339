"""A decoder layer's small operations in C (``kernels.FusedLayer``: RMS norms, RoPE, residual
adds, SiLU · up around the layer's projections): equal to the same layer in PyTorch operations
within fp32 rounding, every row bit for bit the same alone, in any batch and on any thread count
(what keeps speculative and batched decoding equal to plain decoding), and used by a CPU stage
by default, on fp32 and GGUF weights, unless ``COSINE_RAY_FUSED_LAYERS=0``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cosine_ray.models import kernels
from cosine_ray.models.kernels import FUSED_ENV
from cosine_ray.models.llama import LlamaStage, StageBatch, _apply_rope, _rms_norm, _rope_tables
from cosine_ray.models.weights.quant import QuantTensor

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built here")

# heads x head_dim (160) wider than hidden and the MLP: the o projection has the widest input
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 64, 10, 2, 16, 96, 1e-5
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    out = {name: torch.randn(*shape, generator=g) * 0.1 for name, shape in shapes.items()}
    out["input_norm"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    out["post_norm"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    out["qkv_bias"] = torch.randn(QKV, generator=g) * 0.1
    return out


def as_quant(w: torch.Tensor, fmt: str) -> QuantTensor:
    """w quantized to the GGUF format (the blocks the quantized kernel multiplies with)."""
    q = QuantTensor(fmt, torch.from_numpy(np.ascontiguousarray(
        quantize(w.numpy().astype(np.float32), GGMLQuantizationType[fmt]))), w.shape[1])
    return q


def fused_layer(w: dict[str, torch.Tensor], fmt: str | None) -> tuple[kernels.FusedLayer, dict[str, torch.Tensor], list]:
    """The layer on our kernels (fp32 blocks, or GGUF blocks of ``fmt``), and the dense weights it
    multiplies with (the GGUF ones dequantized)."""
    dense, keep, parts = {}, [], {}
    for name, (n, k) in {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM), "gate_up": (2 * INTER, HIDDEN),
                         "down": (HIDDEN, INTER)}.items():
        bias = kernels.pad_bias(w["qkv_bias"]) if name == "qkv" else None
        if fmt is None:
            packed, dense[name] = kernels.pack(w[name]), w[name]
        else:
            q = as_quant(w[name], fmt)
            packed, dense[name] = kernels.pack_quant(q.fmt, *q._fields()), q.dequantize()
        keep += [packed, bias]
        parts[name] = (packed, bias, n, k)
    return kernels.FusedLayer(w["input_norm"], w["post_norm"], EPS, parts), dense, keep


def torch_layer(x, w, dense, positions, attention, rounded=False):
    """The layer as ``LlamaStage._layers`` computes it without the fused calls, and its q, k, v.
    rounded: the projections' inputs rounded to 8 bits a group, as the GGUF kernel does."""
    def mm(a, name):
        return (kernels.round_rows(a) if rounded else a) @ dense[name].t()

    cos, ssin = _rope_tables(positions, 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), torch.float32)
    h = _rms_norm(x, w["input_norm"], EPS)
    qkv = mm(h, "qkv") + w["qkv_bias"]
    qk = _apply_rope(qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM), cos, ssin)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM)
    q, k = qk[:, :HEADS], qk[:, HEADS:]
    x = x + mm(attention(q, k, v), "o")
    h = _rms_norm(x, w["post_norm"], EPS)
    gate, up = mm(h, "gate_up").chunk(2, dim=-1)
    return x + mm(F.silu(gate) * up, "down"), (q, k, v)


def row_attention(q, k, v):
    """A stand-in attention that mixes each row's own heads only (row-local, deterministic)."""
    return (q * k.repeat_interleave(HEADS // KV_HEADS, dim=1) + v.repeat_interleave(HEADS // KV_HEADS, dim=1)).reshape(
        q.shape[0], HEADS * HEAD_DIM)


def fused_run(layer: kernels.FusedLayer, x: torch.Tensor, positions: torch.Tensor):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, ssin = (t.reshape(len(positions), HEAD_DIM).contiguous() for t in _rope_tables(positions, inv_freq, torch.float32))
    x = x.clone()
    scratch = kernels.LayerScratch(x.shape[0], HIDDEN, QKV, INTER, HEADS * HEAD_DIM)
    qkv = layer.pre(x, cos, ssin, HEADS + KV_HEADS, HEAD_DIM, scratch).clone()
    q = qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM)
    layer.post(x, row_attention(q, k, v).contiguous(), scratch)
    return x, qkv


@pytest.mark.parametrize("fmt", [None, "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_a_fused_layer_is_the_pytorch_layer_within_fp32_rounding(fmt, rows):
    w = weights(seed=rows)
    layer, dense, _keep = fused_layer(w, fmt)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(rows) * 7 + 3
    ours, qkv = fused_run(layer, x, positions)
    expected, (q, k, v) = torch_layer(x, w, dense, positions, row_attention, rounded=fmt is not None)
    torch.testing.assert_close(qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM), q, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM), v, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours, expected, atol=5e-5, rtol=5e-5)
    assert not torch.equal(ours, x)  # the layer did something


@pytest.mark.parametrize("fmt", [None, "Q4_1", "Q8_0"])
def test_a_row_is_the_same_alone_in_any_batch_and_on_any_thread_count(fmt):
    layer, _, _keep = fused_layer(weights(seed=3), fmt)
    rows = 11
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(rows) + 40
    whole, _ = fused_run(layer, x, positions)
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(fused_run(layer, x, positions)[0], whole)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 5, rows - 1):
        assert torch.equal(fused_run(layer, x[i:i + 1], positions[i:i + 1])[0][0], whole[i])
    assert torch.equal(fused_run(layer, x[3:9], positions[3:9])[0], whole[3:9])


def test_a_cpu_stage_fuses_its_layers_by_default_and_not_when_told(tiny_checkpoint, monkeypatch):
    state = tiny_checkpoint.load_state_dict()
    fused = LlamaStage(tiny_checkpoint.config, state)
    monkeypatch.setenv(FUSED_ENV, "0")
    plain = LlamaStage(tiny_checkpoint.config, state)
    assert fused.fused is not None and len(fused.fused) == len(fused.layers) and plain.fused is None
    assert LlamaStage(tiny_checkpoint.config, state, dtype=torch.bfloat16).fused is None  # bf16 stays on oneDNN
    ids = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(4)).tolist()

    def logits(stage: LlamaStage) -> torch.Tensor:
        cache = stage.new_kv_cache()
        cache.allocate("r")
        return stage.forward(StageBatch.from_chains(["r"], [ids], [0], last_logits_only=False), cache)

    a, b = logits(fused), logits(plain)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def prefill_logits(stage: LlamaStage, ids: list[int], pieces: list[int], beside: list[int] | None = None) -> torch.Tensor:
    """Every logit of prompt ``ids`` prefilled in chunks of ``pieces`` tokens (continued chains),
    each chunk beside another request's prompt ``beside`` where given."""
    cache = stage.new_kv_cache()
    cache.allocate("r")
    out, start = [], 0
    for n in pieces:
        rids, chains, starts = ["r"], [ids[start:start + n]], [start]
        if beside is not None:
            cache.allocate("o")
            rids, chains, starts = ["o", "r"], [beside, *chains], [0, start]
        logits = stage.forward(StageBatch.from_chains(rids, chains, starts, last_logits_only=False), cache)
        out.append(logits[-n:])
        cache.commit("r")
        start += n
    return torch.cat(out)


def test_a_fused_stage_gives_a_prompt_the_same_bits_however_it_is_prefilled(tiny_checkpoint):
    """Every row of a fused stage attends through ``attend_rows``, prefill chains included: a
    61-token prompt prefilled in one piece, in chunks of 40, 1 and 20 (continued chains), and in
    one piece beside another request's prefill give bit-identical logits for every token. With
    PyTorch's attention for the long chains (before) the chunks differed in the last bits."""
    stage = LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict())
    assert stage.fused is not None
    ids = torch.randint(0, 256, (61,), generator=torch.Generator().manual_seed(8)).tolist()
    other = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(9)).tolist()

    def prefill(pieces, beside=None) -> torch.Tensor:
        return prefill_logits(stage, ids, pieces, beside)

    whole = prefill([61])
    assert torch.equal(prefill([40, 1, 20]), whole)
    assert torch.equal(prefill([61], beside=other), whole)
    assert torch.equal(prefill([1] * 5 + [56]), whole)


def test_a_stages_layers_in_one_call_give_the_bits_of_one_call_a_layer(tiny_checkpoint, monkeypatch):
    """``kernels.FusedStack`` (every layer and its attention in one ``cr_stage_layers`` call)
    against the same stage calling ``pre``, ``attend_rows`` and ``post`` a layer at a time, over
    two prefills, then a token tree beside a chain, then a decode row beside a chain (the rows
    reordered by query length): the same logits, bit for bit, and the same keys and values in
    the pool. Each path is checked to be the one taken."""
    stage = LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict())
    assert stage.fused_stack is not None
    calls = {"stack": 0, "attend_rows": 0}
    stack_call, attend_rows = kernels.FusedStack.__call__, kernels.attend_rows

    def counted(name, call):
        def run(*args, **kwargs):
            calls[name] += 1
            return call(*args, **kwargs)
        return run
    monkeypatch.setattr(kernels.FusedStack, "__call__", counted("stack", stack_call))
    monkeypatch.setattr(kernels, "attend_rows", counted("attend_rows", attend_rows))
    g = torch.Generator().manual_seed(12)
    a, b = torch.randint(0, 256, (23,), generator=g).tolist(), torch.randint(0, 256, (9,), generator=g).tolist()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def run(one_call: bool):
        stage.fused_stack = whole if one_call else None
        cache = stage.new_kv_cache()
        cache.allocate("a")
        cache.allocate("b")
        out = [stage.forward(StageBatch.from_chains(["a", "b"], [a, b], [0, 0], last_logits_only=False), cache)]
        cache.commit("a")
        cache.commit("b")
        step = StageBatch(["a", "b"], [4, 3], torch.tensor([23, 24, 24, 25, 9, 10, 11]), [tree, None],
                          token_ids=torch.tensor([5, 6, 7, 8, 9, 10, 11]))
        out.append(stage.forward(step, cache))
        cache.commit("a", [0, 1, 3])
        cache.commit("b")
        step = StageBatch(["b", "a"], [2, 1], torch.tensor([12, 13, 26]), [None, None],
                          token_ids=torch.tensor([12, 13, 14]))
        out.append(stage.forward(step, cache))
        return out, cache.pool.clone()

    whole = stage.fused_stack
    one, pool_one = run(True)
    assert calls == {"stack": 3, "attend_rows": 0}
    per_layer, pool_per_layer = run(False)
    assert calls == {"stack": 3, "attend_rows": 3 * len(stage.layers)}
    stage.fused_stack = whole
    assert all(torch.equal(x, y) for x, y in zip(one, per_layer))
    assert torch.equal(pool_one, pool_per_layer)


# ---- the rows' attention (kernels.attend_rows) --------------------------------------------------

def pool_and_rows(seed: int, slots: int = 80):
    """A KV pool, and 7 query rows over it with ragged, masked key lists (3 requests: a decode row,
    a 4-node tree and a 2-token chain), as ``plan_attention`` lays them out."""
    g = torch.Generator().manual_seed(seed)
    kpool, vpool = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    q = torch.randn(7, QKV, generator=g)[:, :HEADS * HEAD_DIM].view(7, HEADS, HEAD_DIM)  # strided rows, as in a step
    perm = torch.randperm(slots, generator=g)
    keys = [perm[:30].tolist(),                                   # one decode row: 30 slots
            *[perm[30:50].tolist() + perm[50:54][m].tolist()       # a tree: 20 committed + its ancestors
              for m in ([0], [0, 1], [0, 2], [0, 1, 3])],
            perm[54:70].tolist(), perm[54:71].tolist()]           # a chain: causal
    rows = [0, 1, 2, 3, 4, 5, 6]
    return q, kpool, vpool, rows, keys


def row_keys(rows, keys):
    from cosine_ray.models.attention import RowKeys
    counts = torch.tensor([len(k) for k in keys])
    return RowKeys(torch.tensor(rows), counts.cumsum(0) - counts, counts, torch.tensor([s for k in keys for s in k]),
                   max(map(len, keys)))


def sdpa_rows(q, kpool, vpool, keys, scale):
    out = []
    for i, ks in enumerate(keys):
        k, v = kpool[ks].transpose(0, 1), vpool[ks].transpose(0, 1)  # [kv, L, hd]
        o = F.scaled_dot_product_attention(q[i][:, None], k.repeat_interleave(HEADS // KV_HEADS, 0),
                                           v.repeat_interleave(HEADS // KV_HEADS, 0), scale=scale)
        out.append(o[:, 0].reshape(-1))
    return torch.stack(out)


def test_the_rows_attention_is_pytorchs_within_fp32_rounding():
    q, kpool, vpool, rows, keys = pool_and_rows(seed=5)
    out = torch.full((7, HEADS * HEAD_DIM), float("nan"))
    kernels.attend_rows(q, row_keys(rows, keys), kpool, vpool, HEAD_DIM ** -0.5, out)
    torch.testing.assert_close(out, sdpa_rows(q, kpool, vpool, keys, HEAD_DIM ** -0.5), atol=2e-6, rtol=2e-5)


def test_an_attention_row_is_the_same_alone_in_any_batch_and_on_any_thread_count():
    q, kpool, vpool, rows, keys = pool_and_rows(seed=6)
    whole = torch.zeros(7, HEADS * HEAD_DIM)
    kernels.attend_rows(q, row_keys(rows, keys), kpool, vpool, 0.25, whole)
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            again = torch.zeros_like(whole)
            kernels.attend_rows(q, row_keys(rows, keys), kpool, vpool, 0.25, again)
            assert torch.equal(again, whole)
    finally:
        torch.set_num_threads(threads)
    for i in range(7):  # each row alone (a decode step) writes exactly its row of the batch
        alone = torch.zeros_like(whole)
        kernels.attend_rows(q, row_keys([i], [keys[i]]), kpool, vpool, 0.25, alone)
        assert torch.equal(alone[i], whole[i]) and not alone[[j for j in range(7) if j != i]].any()


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_rows_that_share_keys_get_the_bits_they_get_alone(head_dim):
    """Rows whose lists begin with the same slot share a task and, where two read the same 16
    keys, each key and value vector loaded (``cr_attend_rows``): a 9-node token tree over 40
    committed keys, two requests on the same first 24 slots (prefix-cache blocks) that then part,
    a 19-token causal chain (more rows than a tile) and a decode row. Each row must come out as
    it does alone, at head widths taking every value loop (blocks of 64 floats, then of 16)."""
    heads, kv_heads = 6, 2
    g = torch.Generator().manual_seed(head_dim)
    kpool, vpool = (torch.randn(300, kv_heads, head_dim, generator=g) for _ in range(2))
    perm = torch.randperm(300, generator=g).tolist()
    committed, tree = perm[:40], perm[40:49]
    parents = [-1, 0, 1, 2, 0, 4, 2, 6, 3]
    keys = []
    for i in range(9):  # each tree row: the committed keys, then its ancestors and itself in order
        branch, j = [], i
        while j >= 0:
            branch.append(j)
            j = parents[j]
        keys.append(committed + [tree[b] for b in sorted(branch)])
    keys += [perm[49:73] + perm[73:90], perm[49:73] + perm[90:95]]  # one prefix, then apart
    keys += [perm[100:112 + i] for i in range(19)]                    # a causal chain
    keys.append(perm[150:183])                                        # a decode row
    n = len(keys)
    q = torch.randn(n, heads, head_dim, generator=g)
    whole = torch.zeros(n, heads * head_dim)
    kernels.attend_rows(q, row_keys(list(range(n)), keys), kpool, vpool, head_dim ** -0.5, whole)
    for i in range(n):
        alone = torch.zeros(1, heads * head_dim)
        kernels.attend_rows(q[i:i + 1], row_keys([0], [keys[i]]), kpool, vpool, head_dim ** -0.5, alone)
        assert torch.equal(alone[0], whole[i]), i
    expected = torch.stack([F.scaled_dot_product_attention(
        q[i][:, None], kpool[ks].transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        vpool[ks].transpose(0, 1).repeat_interleave(heads // kv_heads, 0), scale=head_dim ** -0.5)[:, 0].reshape(-1)
        for i, ks in enumerate(keys)])
    torch.testing.assert_close(whole, expected, atol=2e-6, rtol=2e-5)


def test_attend_rows_writes_the_steps_new_keys_before_it_reads_them():
    """``new=(k, v, slots)``: the step's keys and values land in the pool in the same call, and
    rows that see those slots read them."""
    q, kpool, vpool, rows, keys = pool_and_rows(seed=7)
    g = torch.Generator().manual_seed(8)
    k_new, v_new = (torch.randn(3, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    slots = torch.tensor([keys[0][-1], keys[5][-1], keys[6][-1]])
    before = torch.zeros(7, HEADS * HEAD_DIM)
    kernels.attend_rows(q, row_keys(rows, keys), kpool, vpool, 0.25, before)
    got = torch.zeros_like(before)
    written_k, written_v = kpool.clone(), vpool.clone()
    kernels.attend_rows(q, row_keys(rows, keys), written_k, written_v, 0.25, got, new=(k_new, v_new, slots))
    kpool[slots], vpool[slots] = k_new, v_new
    assert torch.equal(written_k, kpool) and torch.equal(written_v, vpool)
    expected = torch.zeros_like(got)
    kernels.attend_rows(q, row_keys(rows, keys), kpool, vpool, 0.25, expected)
    assert torch.equal(got, expected) and not torch.equal(got, before)
