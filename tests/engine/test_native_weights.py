"""Lossless on the native-weights path (``--weights native``: the embedded Q4_1/Q8_0 GGUF blocks
multiplied by int4 kernels with bf16 activations): speculative greedy output, batched, is
exactly our own plain decode on that path. The int4 kernels are row-invariant (a row's result
does not depend on the other rows); attention runs in float64 there (``LlamaStage.
wide_attention``), because in fp32 the CPU kernel's sums depend on the call's shapes and the
bf16 rounding after it turns last-bit differences into other tokens at near-ties
(docs/performance-cpu.md)."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.datasets import held_back_prompts
from cosine_ray.engine.build import build_target_stages
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.models.native import load_weights
from cosine_ray.models.quant import QuantLinear
from support.divergence import divergences

pytestmark = pytest.mark.real_model

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def prompts(real_checkpoint) -> list[list[int]]:
    tokenizer = real_checkpoint.load_tokenizer()
    return [encode_prompt(tokenizer, text) for _, text in held_back_prompts(None, 2)]


def engine(ckpt, drafters: str) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), weights="native",
                                    max_num_seqs=8), checkpoint=ckpt)


def test_native_engine_runs_on_quantized_projections(real_checkpoint):
    eng = engine(real_checkpoint, "none")
    stage = eng.target.stages[0].stage if hasattr(eng.target.stages[0], "stage") else eng.target.stages[0]
    assert isinstance(stage.lm_head, QuantLinear) and stage.lm_head.fmt == "Q8_0"
    assert all(isinstance(layer.gate_up, QuantLinear) and layer.gate_up.fmt == "Q4_1" for layer in stage.layers)


@pytest.mark.parametrize("drafters", ["default", "ngram,self"])
def test_native_speculative_equals_our_native_decode(real_checkpoint, prompts, drafters):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = [o.new_token_ids for o in engine(real_checkpoint, "none").generate(prompts, params)]
    spec_outs = engine(real_checkpoint, drafters).generate(prompts, params)
    assert sum(o.stats.num_accepted_tokens for o in spec_outs) > 0
    worker = TargetWorker(build_target_stages(real_checkpoint, load_weights(real_checkpoint, "native"), 1,
                                              dtype=torch.float32, device="cpu"))
    identical, found = divergences(worker, prompts, plain, [o.new_token_ids for o in spec_outs])
    assert identical == len(prompts), f"native {drafters}: {identical}/{len(prompts)} identical: " + \
        "; ".join(str(d) for d in found)


def test_native_stage_attends_in_float64_on_cpu(real_checkpoint):
    stage = build_target_stages(real_checkpoint, load_weights(real_checkpoint, "native"), 1,
                                dtype=torch.float32, device="cpu")[0]
    dense = build_target_stages(real_checkpoint, load_weights(real_checkpoint, "dense"), 1,
                                dtype=torch.float32, device="cpu")[0]
    assert stage.wide_attention and not dense.wide_attention
