"""Lossless on the native-weights path (``--weights native``: the embedded Q4_1/Q8_0 GGUF blocks
kept quantized): speculative greedy output, batched, is exactly our own plain decode on that
path, and requests decoded together give what each gives alone. On CPU the blocks go, by
default, through our kernel (``models.kernels``: activations rounded to 8 bits a group,
row-invariant), with every attention row computed alone in fp32 (``kernels.attend_rows``);
through PyTorch's int4 kernels (``COSINE_RAY_CPU_GEMM=onednn``: bf16 activations, also
row-invariant) attention runs in float64 (``LlamaStage.wide_attention``), because in fp32 the CPU attention's sums depend on the
call's shapes and the bf16 rounding after it turns last-bit differences into other tokens at
near-ties (docs/performance-cpu.md)."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.datasets import held_back_prompts
from cosine_ray.models.loader import build_stages
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.models import kernels
from cosine_ray.models.weights.native import load_weights
from cosine_ray.models.linear import QuantLinear
from support.divergence import divergences

pytestmark = pytest.mark.real_model

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def prompts(real_checkpoint) -> list[list[int]]:
    tokenizer = real_checkpoint.load_tokenizer()
    return [encode_prompt(tokenizer, text) for _, text in held_back_prompts(None, 2)]


def engine(ckpt, drafters: str) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), weights="native").replace(
        max_num_seqs=8), checkpoint=ckpt)


def test_native_engine_runs_on_quantized_projections(real_checkpoint):
    eng = engine(real_checkpoint, "none")
    stage = eng.target.stages[0].stage if hasattr(eng.target.stages[0], "stage") else eng.target.stages[0]
    assert isinstance(stage.lm_head, QuantLinear) and stage.lm_head.fmt == "Q8_0"
    assert all(isinstance(layer.gate_up, QuantLinear) and layer.gate_up.fmt == "Q4_1" for layer in stage.layers)


@pytest.mark.parametrize("drafters,kernel", [("default", "blocked"), ("ngram,self", "blocked"), ("default", "onednn")])
def test_native_speculative_equals_our_native_decode(real_checkpoint, prompts, drafters, kernel, monkeypatch):
    monkeypatch.setenv(kernels.ENV, kernel)  # our kernel, or PyTorch's int4 one (float64 attention)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = [o.new_token_ids for o in engine(real_checkpoint, "none").generate(prompts, params)]
    spec_outs = engine(real_checkpoint, drafters).generate(prompts, params)
    assert sum(o.stats.num_accepted_tokens for o in spec_outs) > 0
    worker = TargetWorker(build_stages(real_checkpoint, load_weights(real_checkpoint, "native"), 1,
                                              dtype=torch.float32, device="cpu"))
    identical, found = divergences(worker, prompts, plain, [o.new_token_ids for o in spec_outs])
    assert identical == len(prompts), f"native {drafters} ({kernel}): {identical}/{len(prompts)} identical: " + \
        "; ".join(str(d) for d in found)


def test_native_requests_decoded_together_equal_each_alone(real_checkpoint, prompts):
    """Eight prompts at once (their prefills chunked beside each other) against each alone on a
    fresh engine: the same tokens. It fails where the activations are rounded after fp32
    attention (docs/performance-cpu.md, 8-bit activations)."""
    params = SamplingParams(max_tokens=64)
    together = [o.new_token_ids for o in engine(real_checkpoint, "none").generate(prompts, params)]
    alone = [engine(real_checkpoint, "none").generate([p], params)[0].new_token_ids for p in prompts]
    assert len(prompts) == 8 and sum(a == b for a, b in zip(alone, together)) == len(prompts)


@pytest.mark.parametrize("kernel", ["blocked", "onednn"])
def test_native_stage_attends_in_float64_where_its_activations_are_bf16(real_checkpoint, kernel, monkeypatch):
    """PyTorch's int4 kernel (``onednn``/``mkl``) rounds activations to bf16: attention in float64.
    Our kernel keeps them fp32, as the dense path does: fp32 attention."""
    monkeypatch.setenv(kernels.ENV, kernel)
    stage = build_stages(real_checkpoint, load_weights(real_checkpoint, "native"), 1,
                                dtype=torch.float32, device="cpu")[0]
    dense = build_stages(real_checkpoint, load_weights(real_checkpoint, "dense"), 1,
                                dtype=torch.float32, device="cpu")[0]
    ours = kernel == "blocked" and kernels.available()
    assert stage.wide_attention is not ours and not dense.wide_attention
    assert (stage.lm_head.blocked is not None) is ours
