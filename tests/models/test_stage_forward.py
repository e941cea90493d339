"""LlamaStage: whole-model and stage-sliced forward == HF transformers (1e-4 fp32), varlen
batches, tree attention == per-path recompute, KV commit/rollback == fresh recompute."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.algo.tree import TokenTree
from cosine_ray.models import kernels
from cosine_ray.models.config import stage_slices
from cosine_ray.models.linear import onednn_available
from cosine_ray.models.llama import LlamaStage, StageBatch, query_length_order

ATOL = 1e-4
HF_ATOL = {"mkl": 1e-4, "onednn": 3e-4, "blocked": 3e-4}
"""Real model vs transformers, per projection kernel (``COSINE_RAY_CPU_GEMM``): the MKL path
runs the same GEMM transformers runs and stays within 1e-4; oneDNN's kernel sums in another
order (measured max |Δ| 1.7e-4 on logits spanning −31 to +38 here, ~5e-6 of that range; MKL: 0.0). Token
identity with HF greedy decoding is checked separately (``test_greedy_equivalence``)."""
KERNELS = sorted(HF_ATOL)
VARIANTS = ["qwen2", "mistral", "llama3_rope", "tied"]


# ---- helpers -------------------------------------------------------------------------------

def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:  # [n, vocab]
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def whole_model(ckpt) -> LlamaStage:
    return LlamaStage(ckpt.config, ckpt.load_state_dict())


def run_chain(stages: list[LlamaStage], caches, request_id: str, token_ids: list[int], start: int,
              *, commit: bool = True) -> torch.Tensor:  # [n, vocab]
    """Feed a causal chain through the stage chain (hidden states passed along)."""
    batch = StageBatch.from_chains([request_id], [token_ids], [start], last_logits_only=False)
    hidden = None
    for stage, cache in zip(stages, caches):
        if request_id not in cache:
            cache.allocate(request_id)
        hidden = stage.forward(batch, cache, hidden)
        if commit:
            cache.commit(request_id)
    return hidden


def fresh_logits(stage: LlamaStage, token_ids: list[int]) -> torch.Tensor:  # [n, vocab]
    cache = stage.new_kv_cache()
    return run_chain([stage], [cache], "fresh", token_ids, 0)


def tree_batch(request_id: str, tree: TokenTree, committed: int) -> StageBatch:
    positions = torch.tensor(tree.depths(), dtype=torch.long) + committed
    return StageBatch([request_id], [tree.num_nodes], positions, [tree.attention_mask()], None,
                      torch.tensor(tree.token_ids, dtype=torch.long))


def random_tree(root: int, seed: int, vocab: int = 256) -> TokenTree:
    """Branching tree: 3 paths sharing prefixes, depths up to 5, 10+ draft nodes."""
    g = torch.Generator().manual_seed(seed)
    trunk = torch.randint(0, vocab, (5,), generator=g).tolist()
    other = torch.randint(0, vocab, (4,), generator=g).tolist()
    paths = [trunk, trunk[:2] + other[:3], [other[3]] + trunk[1:4], [trunk[0], other[0]]]
    tree = TokenTree.from_paths(root, paths)
    assert tree.num_draft_tokens >= 10 and max(tree.depths()) == 5
    return tree


@pytest.fixture(scope="module")
def tiny_stage(tiny_checkpoint) -> LlamaStage:
    return whole_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny_hf(tiny_checkpoint):
    return tiny_checkpoint.load_hf_model()


@pytest.fixture(scope="module")
def real_stage(real_checkpoint) -> LlamaStage:
    return whole_model(real_checkpoint)


@pytest.fixture(scope="module")
def real_prompt_ids(real_checkpoint) -> list[int]:
    """~60 tokens of a chat-templated prompt."""
    from cosine_ray.engine.local import encode_prompt
    tok = real_checkpoint.load_tokenizer()
    ids = encode_prompt(tok, "Write a Python function that returns the n-th Fibonacci number, "
                             "with a docstring and a short example of how to call it.")
    ids = (ids + tok("def fibonacci(n):\n    \"\"\"Return the n-th number.", add_special_tokens=False)["input_ids"])
    assert 50 <= len(ids) <= 80, len(ids)
    return ids


# ---- (a) whole model == HF -----------------------------------------------------------------

def test_tiny_logits_match_hf(tiny_stage, tiny_hf):
    ids = random_ids(37, seed=1)
    ours = fresh_logits(tiny_stage, ids)
    torch.testing.assert_close(ours, hf_logits(tiny_hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_logits_match_hf(tiny_checkpoint_variants, variant):
    ckpt = tiny_checkpoint_variants[variant]
    ids = random_ids(150 if variant == "llama3_rope" else 37, seed=2)  # past the llama3 original length
    ours = fresh_logits(whole_model(ckpt), ids)
    torch.testing.assert_close(ours, hf_logits(ckpt.load_hf_model(), ids), atol=ATOL, rtol=0)


def test_llama3_scaling_changes_the_rope(tiny_checkpoint_variants):
    """Guard against the scaling silently being ignored: without it the logits differ."""
    from dataclasses import replace
    ckpt = tiny_checkpoint_variants["llama3_rope"]
    ids = random_ids(150, seed=3)
    plain = LlamaStage(replace(ckpt.config, rope_scaling=None), ckpt.load_state_dict())
    assert (fresh_logits(plain, ids) - fresh_logits(whole_model(ckpt), ids)).abs().max() > 1e-2


def test_last_logits_only_and_non_contiguous_logit_rows(tiny_stage):
    ids = random_ids(20, seed=4)
    full = fresh_logits(tiny_stage, ids)
    cache = tiny_stage.new_kv_cache()
    cache.allocate("r")
    last = tiny_stage.forward(StageBatch.from_chains(["r"], [ids], [0]), cache)
    assert last.shape == (1, 256)
    torch.testing.assert_close(last[0], full[-1], atol=1e-5, rtol=0)
    cache.rollback("r", 0)  # drop the speculative level
    batch = StageBatch.from_chains(["r"], [ids], [0], last_logits_only=False)
    batch.logit_indices = torch.tensor([3, 0, 17])
    torch.testing.assert_close(tiny_stage.forward(batch, cache), full[[3, 0, 17]], atol=1e-5, rtol=0)


@pytest.mark.real_model
@pytest.mark.parametrize("kernel", KERNELS)
def test_real_logits_match_hf(kernel, monkeypatch, real_checkpoint, real_hf_model, real_prompt_ids):
    monkeypatch.setenv(kernels.ENV, kernel)
    stage = whole_model(real_checkpoint)
    assert (stage.lm_head.packed is not None) == (kernel == "onednn" and onednn_available())
    assert (stage.lm_head.blocked is not None) == (kernel == "blocked" and kernels.available())
    ours = fresh_logits(stage, real_prompt_ids)
    torch.testing.assert_close(ours, hf_logits(real_hf_model, real_prompt_ids), atol=HF_ATOL[kernel], rtol=0)


# ---- (b) stage-sliced forward: [0,a) + [a,b) + [b,L) chained == whole ----------------------

def sliced_stages(ckpt, bounds) -> list[LlamaStage]:
    state = ckpt.load_state_dict()
    return [LlamaStage(ckpt.config, state, a, b) for a, b in bounds]


@pytest.mark.parametrize("bounds", [[(0, 1), (1, 3), (3, 4)], [(0, 2), (2, 4)], [(0, 3), (3, 4)],
                                    stage_slices(4, 4)])
def test_tiny_sliced_stages_equal_whole(tiny_checkpoint, tiny_stage, bounds):
    stages = sliced_stages(tiny_checkpoint, bounds)
    assert [s.is_first for s in stages] == [True] + [False] * (len(stages) - 1)
    assert [s.is_last for s in stages] == [False] * (len(stages) - 1) + [True]
    caches = [s.new_kv_cache() for s in stages]
    ids = random_ids(30, seed=5)
    # prefill then two decode steps, through the chain, each against a fresh whole-model run
    out = run_chain(stages, caches, "r", ids[:20], 0)
    torch.testing.assert_close(out, fresh_logits(tiny_stage, ids[:20]), atol=1e-5, rtol=0)
    out = run_chain(stages, caches, "r", ids[20:21], 20)
    torch.testing.assert_close(out[-1], fresh_logits(tiny_stage, ids[:21])[-1], atol=1e-5, rtol=0)
    out = run_chain(stages, caches, "r", ids[21:], 21)
    torch.testing.assert_close(out, fresh_logits(tiny_stage, ids)[21:], atol=1e-5, rtol=0)
    for stage, cache in zip(stages, caches):
        assert cache.num_layers == stage.num_layers and cache.committed_length("r") == 30


@pytest.mark.real_model
@pytest.mark.parametrize("kernel", KERNELS)
def test_real_sliced_stages_match_hf(kernel, monkeypatch, real_checkpoint, real_hf_model, real_prompt_ids):
    monkeypatch.setenv(kernels.ENV, kernel)
    stages = sliced_stages(real_checkpoint, [(0, 7), (7, 19), (19, 30)])
    caches = [s.new_kv_cache() for s in stages]
    out = run_chain(stages, caches, "r", real_prompt_ids, 0)
    torch.testing.assert_close(out, hf_logits(real_hf_model, real_prompt_ids), atol=HF_ATOL[kernel], rtol=0)


def test_stage_validation(tiny_checkpoint):
    state = tiny_checkpoint.load_state_dict()
    cfg = tiny_checkpoint.config
    for a, b in [(0, 0), (2, 1), (-1, 2), (0, 5)]:
        with pytest.raises(ValueError, match="layer slice"):
            LlamaStage(cfg, state, a, b)
    middle = LlamaStage(cfg, state, 1, 3)
    assert middle.embed_weight is None and middle.lm_head is None
    with pytest.raises(RuntimeError, match="first stage"):
        middle.embed(torch.tensor([1]))
    with pytest.raises(ValueError, match="num_stages"):
        stage_slices(4, 5)
    assert stage_slices(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]


# ---- (c) varlen batch == each request alone --------------------------------------------------

def test_varlen_batch_equals_each_alone(tiny_stage):
    prompts = [random_ids(n, seed=10 + n) for n in (7, 19, 3)]
    cache = tiny_stage.new_kv_cache()
    for i in range(3):
        cache.allocate(f"r{i}")
    batch = StageBatch.from_chains(["r0", "r1", "r2"], prompts, [0, 0, 0], last_logits_only=False)
    out = tiny_stage.forward(batch, cache)
    assert out.shape == (29, 256)
    for rows, p in zip(out.split([7, 19, 3]), prompts):
        torch.testing.assert_close(rows, fresh_logits(tiny_stage, p), atol=ATOL, rtol=0)
    for i in range(3):
        cache.commit(f"r{i}")
    # decode step mixing lengths 1, 4 and a new request's prefill (a different history length each)
    cache.allocate("r3")
    new = [random_ids(1, seed=20), random_ids(4, seed=21), random_ids(2, seed=22), random_ids(5, seed=23)]
    batch = StageBatch.from_chains(["r0", "r1", "r2", "r3"], new, [7, 19, 3, 0], last_logits_only=False)
    out = tiny_stage.forward(batch, cache)
    for rows, p, n in zip(out.split([1, 4, 2, 5]), prompts + [[]], new):
        torch.testing.assert_close(rows, fresh_logits(tiny_stage, p + n)[len(p):], atol=ATOL, rtol=0)
    # that step's rows were sorted by attention group on CPU and back; with logits only for
    # each request's last token, the rows still come out in batch order
    assert query_length_order([1, 4, 2, 5]) == [0, 2, 1, 3]
    batch = StageBatch.from_chains(["r0", "r1", "r2", "r3"], new, [7, 19, 3, 0])
    last = tiny_stage.forward(batch, cache)
    torch.testing.assert_close(last, out[torch.tensor([0, 4, 6, 11])], atol=ATOL, rtol=0)


# ---- (d) tree attention == per-path recompute ------------------------------------------------

def check_tree_against_paths(stage: LlamaStage, context: list[int], tree: TokenTree, atol: float) -> None:
    """context[:-1] committed, tree root = context[-1]; each node's logits vs its path as a chain."""
    cache = stage.new_kv_cache()
    cache.allocate("r")
    committed = len(context) - 1
    if committed:
        run_chain([stage], [cache], "r", context[:-1], 0)
    assert context[-1] == tree.token_ids[0]
    out = stage.forward(tree_batch("r", tree, committed), cache)
    assert out.shape == (tree.num_nodes, stage.config.vocab_size)
    for node in range(tree.num_nodes):
        path = [tree.token_ids[i] for i in tree.path_to(node)]
        expected = fresh_logits(stage, context[:-1] + path)[-1]
        torch.testing.assert_close(out[node], expected, atol=atol, rtol=0, msg=f"node {node}")


@pytest.mark.parametrize("committed", [0, 1, 23])
def test_tiny_tree_attention_equals_path_recompute(tiny_stage, committed):
    context = random_ids(committed + 1, seed=30 + committed)
    check_tree_against_paths(tiny_stage, context, random_tree(context[-1], seed=committed), ATOL)


def test_tree_and_chains_in_one_varlen_batch(tiny_stage):
    """A prefill chain, a decode tree and a root-only tree scored in one forward."""
    ctx_a, ctx_b, prompt_c = random_ids(12, seed=40), random_ids(5, seed=41), random_ids(9, seed=42)
    tree_a, tree_b = random_tree(ctx_a[-1], seed=43), TokenTree.root_only(ctx_b[-1])
    cache = tiny_stage.new_kv_cache()
    run_chain([tiny_stage], [cache], "a", ctx_a[:-1], 0)
    run_chain([tiny_stage], [cache], "b", ctx_b[:-1], 0)
    cache.allocate("c")
    positions = torch.cat([torch.tensor(tree_a.depths()) + 11, torch.tensor([4]), torch.arange(9)])
    batch = StageBatch(["a", "b", "c"], [tree_a.num_nodes, 1, 9], positions,
                       [tree_a.attention_mask(), tree_b.attention_mask(), None], None,
                       torch.tensor(tree_a.token_ids + tree_b.token_ids + tuple(prompt_c)))
    out_a, out_b, out_c = tiny_stage.forward(batch, cache).split([tree_a.num_nodes, 1, 9])
    for node in range(tree_a.num_nodes):
        path = [tree_a.token_ids[i] for i in tree_a.path_to(node)]
        torch.testing.assert_close(out_a[node], fresh_logits(tiny_stage, ctx_a[:-1] + path)[-1],
                                   atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b[0], fresh_logits(tiny_stage, ctx_b)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_c, fresh_logits(tiny_stage, prompt_c), atol=ATOL, rtol=0)


@pytest.mark.real_model
def test_real_tree_attention_equals_path_recompute(real_stage, real_prompt_ids):
    tree = random_tree(real_prompt_ids[-1], seed=7, vocab=real_stage.config.vocab_size)
    check_tree_against_paths(real_stage, real_prompt_ids, tree, ATOL)


# ---- (e) KV commit / rollback / growth / cap -------------------------------------------------

@pytest.mark.parametrize("accepted_leaf", ["deep_second_branch", "first_child", "root_only"])
def test_commit_accepted_path_then_continue_equals_recompute(tiny_stage, accepted_leaf):
    context = random_ids(15, seed=50)
    tree = random_tree(context[-1], seed=51)
    depths = tree.depths()
    leaf = {"first_child": 1, "root_only": 0,
            # a deepest node whose path is not the node prefix 0,1,2,...: compaction must move slots
            "deep_second_branch": max((n for n in range(tree.num_nodes)
                                       if tree.path_to(n) != list(range(depths[n] + 1))),
                                      key=lambda n: depths[n])}[accepted_leaf]
    keep = tree.path_to(leaf)
    cache = tiny_stage.new_kv_cache()
    run_chain([tiny_stage], [cache], "r", context[:-1], 0)
    tiny_stage.forward(tree_batch("r", tree, 14), cache)
    cache.commit("r", keep)
    committed = context[:-1] + [tree.token_ids[i] for i in keep]
    assert cache.committed_length("r") == len(committed)
    nxt = random_ids(3, seed=52)
    out = run_chain([tiny_stage], [cache], "r", nxt, len(committed))
    torch.testing.assert_close(out, fresh_logits(tiny_stage, committed + nxt)[-3:], atol=ATOL, rtol=0)
    # and a second tree on top of the compacted cache, rooted at nxt[-1] (its KV rolled back)
    cache.rollback("r", 1)
    tree2 = random_tree(nxt[-1], seed=53)
    out = tiny_stage.forward(tree_batch("r", tree2, len(committed) + 2), cache)
    for node in (0, tree2.num_nodes - 1):
        path = [tree2.token_ids[i] for i in tree2.path_to(node)]
        torch.testing.assert_close(out[node], fresh_logits(tiny_stage, committed + nxt[:-1] + path)[-1],
                                   atol=ATOL, rtol=0)


def test_rollback_then_reforward_equals_recompute(tiny_stage):
    ids = random_ids(30, seed=60)
    cache = tiny_stage.new_kv_cache()
    run_chain([tiny_stage], [cache], "r", ids[:25], 0)
    cache.rollback("r", 7)
    assert cache.committed_length("r") == 18
    other = random_ids(6, seed=61)
    out = run_chain([tiny_stage], [cache], "r", other, 18)
    torch.testing.assert_close(out, fresh_logits(tiny_stage, ids[:18] + other)[18:], atol=ATOL, rtol=0)
    cache.truncate("r", 10)
    out = run_chain([tiny_stage], [cache], "r", ids[10:30], 10)
    torch.testing.assert_close(out, fresh_logits(tiny_stage, ids)[10:], atol=ATOL, rtol=0)
    # an uncommitted speculative level (a tree rooted at ids[29]) is dropped by rollback(0)
    cache.rollback("r", 1)
    tiny_stage.forward(tree_batch("r", random_tree(ids[29], seed=62), 29), cache)
    cache.rollback("r", 0)
    assert cache.committed_length("r") == 29 and cache.num_tokens() == 29
    out = run_chain([tiny_stage], [cache], "r", ids[29:30], 29)
    torch.testing.assert_close(out[-1], fresh_logits(tiny_stage, ids)[-1], atol=ATOL, rtol=0)


def test_cache_grows_past_initial_capacity(tiny_stage):
    ids = random_ids(70, seed=70)
    cache = tiny_stage.new_kv_cache(initial_capacity=4)
    outs = [run_chain([tiny_stage], [cache], "r", ids[:3], 0)]
    for start, end in [(3, 4), (4, 11), (11, 12), (12, 40), (40, 70)]:
        outs.append(run_chain([tiny_stage], [cache], "r", ids[start:end], start))
    torch.testing.assert_close(torch.cat(outs), fresh_logits(tiny_stage, ids), atol=ATOL, rtol=0)
    # a tree that needs growth while a committed prefix must survive the copy
    cache2 = tiny_stage.new_kv_cache(initial_capacity=16)
    run_chain([tiny_stage], [cache2], "r", ids[:13], 0)
    tree = random_tree(ids[13], seed=71)  # 13 + 12 nodes > 16 slots
    out = tiny_stage.forward(tree_batch("r", tree, 13), cache2)
    last = tree.num_nodes - 1
    path = [tree.token_ids[i] for i in tree.path_to(last)]
    torch.testing.assert_close(out[last], fresh_logits(tiny_stage, ids[:13] + path)[-1], atol=ATOL, rtol=0)
    # compacting commit (outside inference mode) on the buffer grown inside the forward
    keep = tree.path_to(last)
    assert keep != list(range(len(keep)))
    cache2.commit("r", keep)
    committed = ids[:13] + path
    out = run_chain([tiny_stage], [cache2], "r", ids[40:43], len(committed))
    torch.testing.assert_close(out, fresh_logits(tiny_stage, committed + ids[40:43])[-3:], atol=ATOL, rtol=0)


def test_max_tokens_cap_raises_memory_error(tiny_stage):
    cache = tiny_stage.new_kv_cache(max_tokens=20)
    run_chain([tiny_stage], [cache], "a", random_ids(12, seed=80), 0)
    cache.allocate("b")
    with pytest.raises(MemoryError, match="max_tokens=20"):
        tiny_stage.forward(StageBatch.from_chains(["b"], [random_ids(9, seed=81)], [0]), cache)
    # exactly at the cap is fine
    out = tiny_stage.forward(StageBatch.from_chains(["b"], [random_ids(8, seed=81)], [0]), cache)
    assert out.shape == (1, 256) and cache.num_tokens() == 20


# ---- half-precision projections on a CPU without a native half GEMM -----------------------

@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_projection_is_computed_in_fp32_where_the_cpu_has_no_half_gemm(monkeypatch, native, dtype):
    """Without a native bf16/fp16 GEMM, PyTorch's half ``x @ w_t`` on CPU is a slow fallback
    (50x fp32 at 256 rows on our AVX2 CPU): the projection keeps the weight in fp32 and rounds its
    fp32 product once. With one, the weight stays in its dtype."""
    from cosine_ray.models import linear

    monkeypatch.setenv(kernels.ENV, "mkl")  # no oneDNN packing: the ``w_t`` forms
    monkeypatch.setattr(linear, "_native_half_gemm", lambda d: native)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(5, 32, generator=g).to(dtype)
    for b in (None, bias):
        proj = linear.DenseLinear(weight, b)
        assert proj.upcast is not native and proj.packed is None
        assert proj.w_t.dtype == (dtype if native else torch.float32)
        y = proj(x)
        assert y.dtype == dtype and y.shape == (5, 48)
        exact = x.float() @ weight.float().t() + (0 if b is None else b.float())
        if not native:  # the fp32 product, rounded once
            assert torch.equal(y, exact.to(dtype))
        torch.testing.assert_close(y.float(), exact, atol=0.1, rtol=0.02)


# ---- RoPE: q and k rotated together, in transformers' exact arithmetic --------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_transformers_rotation_bit_for_bit(dtype):
    """The stage's rotation (roll by head_dim / 2 times a signed sin, q and k as one tensor cut
    out of the fused projection) equals ``x * cos + rotate_half(x) * sin`` exactly, not just
    closely: an fp32 forward must stay token-identical to transformers'."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from cosine_ray.models.llama import _apply_rope, _rope_tables

    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv, head_dim, tokens = 9, 3, 64, 17
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv) * head_dim, generator=gen) * 4).to(dtype)
    cos, signed_sin = _rope_tables(positions, inv_freq, dtype)
    ours = _apply_rope(qkv[:, :(num_heads + num_kv) * head_dim].view(tokens, num_heads + num_kv, head_dim),
                       cos, signed_sin)
    emb = torch.cat([positions[:, None].float() * inv_freq[None, :]] * 2, dim=-1)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim).transpose(0, 1)[None]
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv) * head_dim].view(tokens, num_kv, head_dim).transpose(0, 1)[None]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, emb.cos()[None].to(dtype), emb.sin()[None].to(dtype))
    assert torch.equal(ours[:, :num_heads], ref_q[0].transpose(0, 1))
    assert torch.equal(ours[:, num_heads:], ref_k[0].transpose(0, 1))
