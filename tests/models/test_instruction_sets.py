"""The kernels give the same bits on every instruction set: the library built for this CPU
against copies built without AVX-512 (8-lane AVX2 paths) and without AVX2 either (plain C on
8-lane vectors), entry point by entry point: the attention of rows (chains, trees, shared
prefixes, every head width path), a layer's calls around its projections, and a whole stage's
steps (``cr_stage_layers``), on fp32 and GGUF weights of every format. (Where this CPU lacks
AVX-512 the first copy is the library in use; the comparison still holds.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosine_ray.models import kernels
from cosine_ray.models.attention import RowKeys
from cosine_ray.models.kernels import attention, build, gemm, layer, qgemm, stage
from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.weights.quant import FORMATS, K_FORMATS, gguf_weights
from gguf_blocks import quantize_blocks
from test_k_quants import k_config, write_k_file
from test_quant import tiny_config, tiny_state, write_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built here")

NARROW = {"avx2": ("-mno-avx512f",), "plain": ("-mno-avx2",), "no-vnni": ("-mno-avx512vnni", "-mno-avxvnni")}
"""Copies of the library: without AVX-512, without AVX2 either, and without VNNI (plain C integer
sums beside AVX-512's fp32)."""


@pytest.fixture(scope="module")
def narrow(tmp_path_factory) -> dict:
    out = {}
    for name, flags in NARROW.items():
        path = tmp_path_factory.mktemp("lib") / f"{name}.so"
        build.compile_library(path, "cc", Path(torch.__file__).parent / "lib", flags)
        out[name] = build.load(path)
    return out


def using(lib, monkeypatch) -> None:
    """Every kernel wrapper calls ``lib`` instead of this machine's library."""
    for module in (attention, gemm, layer, qgemm, stage):
        monkeypatch.setattr(module, "library", lambda: lib)


def key_lists(g: torch.Generator, slots: int) -> list[list[int]]:
    """A decode row, a 9-node token tree over 40 committed keys, two requests on one 24-key
    prefix that then part, a 37-token prefill chain after 30 cached keys (several tiles) and a
    chain that starts fresh."""
    perm = torch.randperm(slots, generator=g).tolist()
    committed, tree, parents = perm[:40], perm[40:49], [-1, 0, 1, 2, 0, 4, 2, 6, 3]
    lists = [perm[300:333]]
    for i in range(9):
        branch, j = [], i
        while j >= 0:
            branch.append(j)
            j = parents[j]
        lists.append(committed + [tree[b] for b in sorted(branch)])
    lists += [perm[49:73] + perm[73:90], perm[49:73] + perm[90:95]]
    lists += [perm[100:131 + i] for i in range(37)]
    lists += [perm[200:201 + i] for i in range(5)]
    return lists


def row_keys(lists: list[list[int]]) -> RowKeys:
    """Lists as ``plan_attention`` lays them out: a chain's rows share one list (same start)."""
    starts, flat = [], []
    for i, ks in enumerate(lists):
        prev = lists[i - 1] if i else None
        if prev is not None and len(ks) == len(prev) + 1 and ks[:-1] == prev and starts[-1] + len(prev) == len(flat) \
                and flat[starts[-1]:] == prev:
            flat.append(ks[-1])
            starts.append(starts[-1])
            continue
        starts.append(len(flat))
        flat += ks
    counts = torch.tensor([len(k) for k in lists])
    return RowKeys(torch.arange(len(lists)), torch.tensor(starts), counts, torch.tensor(flat), int(counts.max()))


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (16, 6, 2), (80, 4, 2), (128, 2, 1), (72, 4, 4)])
def test_the_attention_of_rows_is_the_same_on_every_instruction_set(head_dim, heads, kv_heads, narrow, monkeypatch):
    """Chains (their rows scored and summed in tiles), a tree, a fork and a decode row, at head
    widths that take every path (blocks of 64 floats, of 16, and serial sums for 72)."""
    g = torch.Generator().manual_seed(head_dim)
    kpool, vpool = (torch.randn(400, kv_heads, head_dim, generator=g) for _ in range(2))
    lists = key_lists(g, 400)
    keys = row_keys(lists)
    assert len(set(keys.start.tolist())) < len(lists)  # the chains share their lists
    q = torch.randn(len(lists), heads, head_dim, generator=g)

    def run() -> torch.Tensor:
        out = torch.full((len(lists), heads * head_dim), float("nan"))
        keys.scores = None
        kernels.attend_rows(q, keys, kpool, vpool, head_dim ** -0.5, out)
        return out

    ours = run()
    assert not ours.isnan().any()
    for lib in narrow.values():
        using(lib, monkeypatch)
        assert torch.equal(run(), ours)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_formats_products_are_the_same_on_every_instruction_set(fmt, narrow, monkeypatch):
    """1 to 7 rows (every tile width) of every GGUF format, ragged output columns."""
    k = 512 if fmt in K_FORMATS else 576
    w = np.random.default_rng(2).normal(0.0, 0.05, (100, k)).astype(np.float32)
    packed = kernels.pack_quant(fmt, *quantize_blocks(w, fmt)._fields())
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(4))
    ours = [kernels.linear_quant(x[:rows], packed) for rows in range(1, 8)]
    for lib in narrow.values():
        assert all(torch.equal(kernels.linear_quant(x[:rows], packed, lib=lib), y) for rows, y in zip(range(1, 8), ours))


@pytest.mark.parametrize("weights", ["dense", "Q4_1", "mixed K formats"])
def test_a_stages_steps_are_the_same_on_every_instruction_set(weights, tiny_checkpoint, tmp_path, narrow,
                                                             monkeypatch):
    """A fused stage (``cr_stage_layers``: norms, RoPE, projections, attention, MLP) over two
    prefills beside each other, a token tree beside a decode row, then a chunk continuing a
    prefill: every logit, bit for bit, and the same keys and values in the pool."""
    if weights == "dense":
        config, state = tiny_checkpoint.config, tiny_checkpoint.load_state_dict()
    elif weights != "Q4_1":
        config = k_config()
        write_k_file(tmp_path / "k.gguf", config, seed=6)
        state = gguf_weights(tmp_path / "k.gguf", num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    else:
        config = tiny_config()
        write_gguf(tmp_path / "m.gguf", config, tiny_state(config, seed=3), "Q4_1", "Q8_0")
        state = gguf_weights(tmp_path / "m.gguf", num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (41, 9, 23))

    def run(lib) -> tuple[list[torch.Tensor], torch.Tensor]:
        if lib is not None:
            using(lib, monkeypatch)
        stage = LlamaStage(config, state)
        assert stage.fused_stack is not None
        cache = stage.new_kv_cache()
        for rid in "ab":
            cache.allocate(rid)
        out = [stage.forward(StageBatch.from_chains(["a", "b"], [a, b], [0, 0], last_logits_only=False), cache)]
        cache.commit("a")
        cache.commit("b")
        step = StageBatch(["a", "b"], [4, 1], torch.tensor([41, 42, 42, 43, 9]), [tree, None],
                          token_ids=torch.tensor([1, 2, 3, 4, 5]) % vocab)
        out.append(stage.forward(step, cache))
        cache.commit("a", [0, 1, 3])
        cache.commit("b")
        out.append(stage.forward(StageBatch.from_chains(["b"], [c], [10], last_logits_only=False), cache))
        return out, cache.pool.clone()

    ours, pool = run(None)
    for lib in narrow.values():
        logits, lib_pool = run(lib)
        assert all(torch.equal(x, y) for x, y in zip(logits, ours)) and torch.equal(lib_pool, pool)
