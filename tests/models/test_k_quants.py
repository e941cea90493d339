"""GGUF's K formats (Q4_K, Q5_K, Q6_K) and the mixed files llama.cpp writes (``_M``: K formats
beside Q5_0 / Q5_1 / Q8_0 fallbacks, one projection's rows in two formats): the blocks read as
``gguf``'s reference dequantizes them, our kernel's products equal to the file's weights times
the 8-bit rounded rows, every row's result the same in any batch, a projection in mixed formats
built in parts, and a stage on such a file giving a prompt the same bits however it is
prefilled, close to the same stage on the file's weights dequantized."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from cosine_ray.models import kernels, linear
from cosine_ray.models.config import ModelConfig
from cosine_ray.models.linear import DenseLinear, QuantLinear, StackedLinear, kernel_operand, projection
from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.weights.quant import K_FORMATS, QuantTensor, as_dense, gguf_weights
from gguf_blocks import quantize_blocks
from test_fused_layers import prefill_logits

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built here")


def weight(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.05, (rows, cols)).astype(np.float32)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_blocks_dequantize_as_the_gguf_reference_does(fmt):
    """Our reading of the blocks (scales and mins in 12 bytes, high bits apart) against
    ``gguf``'s dequantizer, bit for bit, and near the weights they came from."""
    w = weight(24, 512, 1)
    q = quantize_blocks(w, fmt)
    ref = dequantize(q.blocks.numpy(), GGMLQuantizationType[fmt]).reshape(w.shape)
    assert torch.equal(q.dequantize(), torch.from_numpy(ref))
    assert np.abs(ref - w).max() < {"Q4_K": 0.03, "Q5_K": 0.015, "Q6_K": 0.008}[fmt]


def test_only_the_4_bit_k_format_has_an_int4_form():
    q = quantize_blocks(weight(8, 256, 2), "Q4_K")
    u, s, z = q.int4_affine()
    w = (u.double() - 8) * s.double().repeat_interleave(32, 1) + z.double().repeat_interleave(32, 1)
    torch.testing.assert_close(w.float(), q.dequantize(), rtol=0, atol=1e-6)
    for fmt in ("Q5_K", "Q6_K", "Q5_0", "Q5_1"):
        with pytest.raises(ValueError, match="no int4 form"):
            quantize_blocks(weight(8, 256, 2), fmt).int4_affine()


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows,k,n", [(1, 512, 96), (3, 256, 49), (17, 1536, 64), (6, 768, 100)])
def test_k_products_are_the_files_weights_times_the_rounded_rows_within_fp32_rounding(fmt, rows, k, n):
    q = quantize_blocks(weight(n, k, rows), fmt)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 2
    y = kernels.linear_quant(x, kernels.pack_quant(fmt, *q._fields()))
    w, xr = q.dequantize().double(), kernels.round_rows(x).double()
    exact = xr @ w.t()
    bound = 8 * k * torch.finfo(torch.float32).eps * (xr.abs() @ w.abs().t() + 1)
    assert y.shape == (rows, n) and ((y.double() - exact).abs() <= bound).all()
    assert (y.double() - x.double() @ w.t()).abs().max() > 1e-5  # the rows were rounded


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_every_split_of_rows_into_tiles_gives_a_k_row_its_bits(fmt):
    """1 to 13 rows in tiles of 1 to 6 rows (Q6_K's of at most 4): each row as it is alone, on 1
    and 3 threads."""
    packed = kernels.pack_quant(fmt, *quantize_blocks(weight(64, 512, 5), fmt)._fields())
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([kernels.linear_quant(x[i:i + 1], packed) for i in range(13)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            for rows in range(1, 14):
                assert torch.equal(kernels.linear_quant(x[:rows], packed), alone[:rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_k_layouts_keep_the_files_size():
    """Codes at 4 bits (Q4_K) or a byte (Q5_K, Q6_K), the superblocks' fp16 scales and the
    groups' scale bytes: Q4_K reads 4.625 bits a weight, as many as the file less its padding."""
    n, k = 64, 512
    q4 = kernels.pack_quant("Q4_K", *quantize_blocks(weight(n, k, 7), "Q4_K")._fields())
    q6 = kernels.pack_quant("Q6_K", *quantize_blocks(weight(n, k, 7), "Q6_K")._fields())
    assert q4.codes.shape == (2, k // 2, 32) and q4.mins is not None and q4.sub.shape == (2, k // 32, 2, 32)
    assert q4.nbytes == n * k // 2 + 2 * 2 * n * k // 256 + 2 * n * k // 32
    assert q6.codes.shape == (2, k, 32) and q6.mins is None and q6.sub.shape == (2, k // 32, 2, 32)


def test_a_projection_in_mixed_formats_is_built_in_parts(monkeypatch, caplog):
    """q and k in Q5_0, v in Q8_0 (as llama.cpp's Q4_K_M writes a layer of a small model): one
    part a format, their outputs side by side, each exactly what its part alone gives; with
    PyTorch's int4 kernels a format without an int4 form is dequantized, and the log says so."""
    cpu = torch.device("cpu")
    q, k, v = (quantize_blocks(weight(n, 256, i), f) for i, (n, f) in enumerate([(64, "Q5_0"), (32, "Q5_0"), (32, "Q8_0")]))
    bias = torch.randn(128)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    m = projection([q, k, v], bias, dtype=torch.float32, device=cpu)
    assert isinstance(m, StackedLinear) and [p.out_features for p in m.parts] == [96, 32] and m.out_features == 128
    alone = [QuantLinear(QuantTensor.cat([q, k]), dtype=torch.float32, device=cpu, bias=bias[:96]),
             QuantLinear(v, dtype=torch.float32, device=cpu, bias=bias[96:])]
    assert torch.equal(m(x), torch.cat([p(x) for p in alone], dim=-1))
    if kernels.available():
        operands = kernel_operand(m)
        assert isinstance(operands, list) and [o[2] for o in operands] == [96, 32]
    monkeypatch.setenv(kernels.ENV, "onednn")
    monkeypatch.setattr(linear, "_DEQUANTIZED", set())
    with caplog.at_level(logging.WARNING, logger="cosine_ray.models.linear"):
        m = projection([q, k, v], None, dtype=torch.float32, device=cpu)
        projection([q], None, dtype=torch.float32, device=cpu)
    assert isinstance(m.parts[0], DenseLinear) and isinstance(m.parts[1], QuantLinear)
    assert kernel_operand(m) is None
    said = [r.getMessage() for r in caplog.records]
    assert sum("Q5_0 has no int4 form" in line for line in said) == 1 and not any("Q8_0" in line for line in said)
    torch.testing.assert_close(m.parts[0](x), x @ QuantTensor.cat([q, k]).dequantize().t(), atol=1e-5, rtol=0)


# ---- a file in mixed formats ------------------------------------------------------------------

def k_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True)


FILE_FORMATS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_K",
                "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
"""A Q4_K_M-like mix: q, k and v in two formats, Q6_K for v and down, a 32-weight fallback."""
_GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_k_file(path, cfg: ModelConfig, seed: int) -> None:
    """A llama GGUF as llama.cpp writes one (q/k rows permuted), its matrices in ``FILE_FORMATS``."""
    g = np.random.default_rng(seed)
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_layers)

    def add(name: str, value: np.ndarray, fmt: str) -> None:
        if fmt == "F32":
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
            return
        q = quantize_blocks(value, fmt)
        writer.add_tensor(name, q.blocks.numpy(), raw_dtype=GGMLQuantizationType[fmt])

    add("token_embd.weight", g.normal(0, 0.2, (cfg.vocab_size, h)), FILE_FORMATS["token_embd"])
    add("output_norm.weight", 1 + g.normal(0, 0.1, h), "F32")
    for n in range(cfg.num_layers):
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        for part, shape in shapes.items():
            value = g.normal(0, 0.08, shape).astype(np.float32)
            if part in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's converter permutes q and k
                heads = cfg.num_heads if "q_proj" in part else cfg.num_kv_heads
                value = value.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(1, 2).reshape(shape)
            add(f"blk.{n}.{_GGUF_PARTS[part]}.weight", value, FILE_FORMATS[_GGUF_PARTS[part]])
        for part in ("input_layernorm", "post_attention_layernorm"):
            add(f"blk.{n}.{_GGUF_PARTS[part]}.weight", 1 + g.normal(0, 0.1, h), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    cfg = k_config()
    path = tmp_path_factory.mktemp("k") / "m.gguf"
    write_k_file(path, cfg, seed=4)
    return cfg, gguf_weights(path, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)


def test_a_mixed_file_is_read_in_its_formats(k_file):
    cfg, weights = k_file
    assert weights["model.layers.0.self_attn.q_proj.weight"].fmt == "Q4_K"
    assert weights["model.layers.1.self_attn.v_proj.weight"].fmt == "Q6_K"
    assert weights["model.layers.0.mlp.down_proj.weight"].fmt == "Q6_K"
    assert weights["model.embed_tokens.weight"].fmt == "Q8_0"
    stage = LlamaStage(cfg, weights)
    layer = stage.layers[0]
    assert isinstance(layer.qkv, StackedLinear) and [p.fmt for p in layer.qkv.parts] == ["Q4_K", "Q6_K"]
    assert isinstance(layer.gate_up, QuantLinear) and layer.gate_up.fmt == "Q5_K"


@needs_kernels
def test_a_stage_on_a_mixed_file_gives_a_prompt_the_same_bits_however_it_is_prefilled(k_file):
    """The fused stage (every projection in its own format, q and k apart from v): whole, in
    chunks of 20, 1 and 19, and beside another request, every logit bit for bit."""
    cfg, weights = k_file
    stage = LlamaStage(cfg, weights)
    assert stage.fused_stack is not None and not stage.wide_attention
    g = torch.Generator().manual_seed(8)
    ids, other = torch.randint(0, 96, (40,), generator=g).tolist(), torch.randint(0, 96, (23,), generator=g).tolist()

    def prefill(pieces, beside=None) -> torch.Tensor:
        return prefill_logits(stage, ids, pieces, beside)

    whole = prefill([40])
    assert torch.equal(prefill([20, 1, 19]), whole)
    assert torch.equal(prefill([40], beside=other), whole)


def test_a_stage_on_a_mixed_file_follows_its_dense_twin(k_file):
    """Native against the same weights dequantized (exactly the file's weights): the logits differ
    by the 8-bit rounding of the projections' inputs only; the greedy tokens mostly agree."""
    cfg, weights = k_file
    native = LlamaStage(cfg, weights)
    dense = LlamaStage(cfg, {k: as_dense(v) for k, v in weights.items()})
    tokens = [3, 17, 42, 5, 77, 11, 60, 2, 9, 31]
    outs = []
    for stage in (native, dense):
        kv = stage.new_kv_cache()
        kv.allocate("r")
        outs.append(stage.forward(StageBatch.from_chains(["r"], [tokens], [0], last_logits_only=False), kv))
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.3)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.75
