"""The engine on CUDA (marked ``gpu``: skipped where no GPU is visible, as on our CPU
machines and CI; run them on a GPU machine with ``python -m pytest -m gpu``).

- fp32 on CUDA: speculative greedy output token-identical to HF greedy (CPU reference);
- bf16 on CUDA: speculative output against our own non-speculative bf16 decode on the GPU,
  every divergence a near-tie of the two tokens' logits (the rule of
  ``test_greedy_equivalence.test_real_bf16_speculative_equals_our_bf16_decode``);
- the verify steps replay CUDA graphs (``models.runner``): mixed steps give the eager
  forward's ids and logits, and the engine on graphs is the fp32 HF greedy text above;
- stage and KV tensors really live on the GPU, and the profiler's timings wait for it.
"""

from __future__ import annotations

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from support.hf_reference import hf_greedy
from support.runner_steps import compare_runners

pytestmark = pytest.mark.gpu

MAX_TOKENS = 30


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 33)] + [list(range(10, 22)) * 3]


def make_engine(ckpt, drafters: str, dtype: str = "float32", num_lanes: int = 1) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), device="cuda", dtype=dtype).replace(
            max_num_seqs=8, num_lanes=num_lanes),
                       checkpoint=ckpt)


@pytest.mark.parametrize("drafters, num_lanes", [("none", 1), ("ngram", 1), ("self", 1), ("ngram", 2)])
def test_fp32_on_cuda_equals_hf_greedy(tiny_checkpoint, prompts, drafters, num_lanes):
    """With 2 lanes one lane's step is planned while the GPU verifies the other's."""
    hf = tiny_checkpoint.load_hf_model()
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(tiny_checkpoint, drafters, num_lanes=num_lanes)
    assert engine.target.stages[0].stage.device.type == "cuda"
    at_start = engine.target.stages[0].runner.stats["captures"]
    # at start: batches 1-8 × trees of 1, 2, 4, 8, 9 rows (γ_max + 1) × contexts 256-1024, and the
    # prefill buckets of batches 1-8 × 64-512 rows within those contexts and 2,048 rows (42)
    assert at_start == 4 * 5 * 3 + 42, at_start
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in outs] == want
    stats = engine.target.stages[0].runner.stats
    assert stats["graph"] > 0 and stats["captures"] > 0, stats  # auto on CUDA: graphs


def test_graph_runner_equals_eager_on_cuda(tiny_checkpoint):
    graph = compare_runners(tiny_checkpoint, "graph", "cuda", atol=1e-4, tree_size=9)
    stats = [s.runner.stats for s in graph.stages]
    assert all(s["graph"] == 10 + 2 * 4 and s["eager"] == 0 and s["captures"] >= 3 for s in stats), stats


def test_enforce_eager_on_cuda_captures_nothing(tiny_checkpoint, prompts):
    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram"),
                                      device="cuda").replace(runner="eager"), checkpoint=tiny_checkpoint)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))
    stats = engine.target.stages[0].runner.stats
    assert stats["graph"] == 0 and stats["captures"] == 0 and stats["eager"] > 0, stats


def test_bf16_on_cuda_equals_our_bf16_decode(tiny_checkpoint, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = [o.new_token_ids for o in make_engine(tiny_checkpoint, "none", "bfloat16").generate(prompts, params)]
    spec = [o.new_token_ids for o in make_engine(tiny_checkpoint, "ngram,self", "bfloat16").generate(prompts, params)]
    # the tiny random model has no near-ties, so there is nothing to excuse
    assert spec == plain


def test_profile_on_cuda(tiny_checkpoint):
    from cosine_ray.engine.profile import run_profile
    model = run_profile(EngineConfig(model=str(tiny_checkpoint.path), drafters=(), device="cuda"), quick=True)
    assert model.device == "cuda" and model.predict_llm([100], [4]) > 0


def test_stage_actor_output_crosses_processes(tiny_checkpoint):
    """A stage actor's return value is pickled by Ray: on CUDA the last stage's ``forward``
    waits for its ids and drops the CUDA event (the in-process engine polls it instead)."""
    import pickle

    from cosine_ray.algo.tree import TokenTree
    from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
    from cosine_ray.engine.worker.target import StageWorker
    from cosine_ray.models.llama import LlamaStage

    stage = LlamaStage(tiny_checkpoint.config, tiny_checkpoint.load_state_dict(), device="cuda")
    worker = StageWorker(stage, kv_budget_bytes=2**20)
    out = worker.forward([ScoreItem.prefill("r", [1, 2, 3], ids_only=True)])
    assert out.ready is None and out.token_ids.shape == (1,)
    assert pickle.loads(pickle.dumps(out)).token_ids.tolist() == out.token_ids.tolist()
    tree = TokenTree((4,), (-1,), (1.0,))
    pending = worker.forward_pending([ScoreItem.for_tree("r", tree, 3, ids_only=True)], None, [KVCommit("r", (0, 1, 2))])
    assert pending.ready is not None  # the in-process path keeps it asynchronous


def test_eager_bf16_steps_do_not_use_cudnn_attention(tiny_checkpoint, prompts):
    """cuDNN attention builds a plan on the host for every new shape (1.35 ms per call on an
    H200), and eager steps' shapes change with every prompt: they use the other kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram"),
                                      device="cuda", dtype="bfloat16").replace(runner="eager"), checkpoint=tiny_checkpoint)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, SamplingParams(max_tokens=8))
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
