"""GGUF blocks kept quantized (``models.weights.quant``, ``models.weights.native``): decoding against the ``gguf``
package's own reference, the int4 kernels' affine form, a written GGUF file read back under our
names (llama.cpp's q/k row permutation undone), and stages built on native weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from cosine_ray.models import kernels
from cosine_ray.models.config import ModelConfig
from cosine_ray.models.linear import QuantLinear, _cuda_inner_k_tiles, pack_int4_for_cuda
from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.weights.native import NATIVE_FILE, _read_native_file, resolve_weights, write_native_file
from cosine_ray.models.weights.quant import (FORMATS, INT4_FORMATS, K_FORMATS, QuantTensor, _unpermute_rows,
                                              as_dense, gguf_weights, hf_name)

FMTS = sorted(set(FORMATS) - set(K_FORMATS))
"""The formats of 32-weight blocks, which ``gguf`` quantizes (the K formats: ``test_k_quants``)."""


def blocks_of(weight: np.ndarray, fmt: str) -> QuantTensor:
    """weight  # [rows, cols] fp32 quantized by the gguf package (llama.cpp's reference code)."""
    data = quantize(weight.astype(np.float32), GGMLQuantizationType[fmt])
    return QuantTensor(fmt, torch.from_numpy(np.ascontiguousarray(data)), weight.shape[1])


def random_weight(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.05, (rows, cols)).astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_equals_the_gguf_reference(fmt):
    q = blocks_of(random_weight(48, 96, 1), fmt)
    ref = dequantize(q.blocks.numpy(), GGMLQuantizationType[fmt])
    assert torch.equal(q.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("fmt", sorted(set(INT4_FORMATS) - set(K_FORMATS)))
def test_int4_affine_form_holds_the_same_weights(fmt):
    q = blocks_of(random_weight(40, 64, 2), fmt)
    u, s, z = q.int4_affine()
    assert u.min() >= 0 and u.max() <= 15
    w = (u.double() - 8) * s.double().repeat_interleave(32, 1) + z.double().repeat_interleave(32, 1)
    if fmt == "Q8_0":  # [high | low]: the two halves add up to the file's weight
        w = w[:, :q.cols] + w[:, q.cols:]
    torch.testing.assert_close(w.float(), q.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_quant_linear_on_our_kernel_is_8_bit_activations_times_the_weights(fmt, rows):
    if not kernels.available():
        pytest.skip("no C compiler: our kernel is not built here")
    q = blocks_of(random_weight(64, 128, 3), fmt)
    layer = QuantLinear(q, dtype=torch.float32, device=torch.device("cpu"))
    assert layer.blocked is not None and layer.packed is None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert y.shape == (rows, 64) and y.dtype == torch.float32
    # the file's weights, exactly, times x rounded to 8 bits a group of 32 (llama.cpp's Q8 operand)
    ref = kernels.round_rows(x).double() @ q.dequantize().double().t()
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5)
    assert (y.double() - x.double() @ q.dequantize().double().t()).abs().max() > 1e-5  # it did round


@pytest.mark.parametrize("fmt", sorted(set(INT4_FORMATS) - set(K_FORMATS)))
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_quant_linear_matches_bf16_activations_times_the_weights(fmt, rows, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "onednn")  # PyTorch's int4 kernel
    q = blocks_of(random_weight(64, 128, 3), fmt)
    layer = QuantLinear(q, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    assert y.shape == (rows, 64) and y.dtype == torch.float32
    ref = x.bfloat16().double() @ q.dequantize().double().t()
    # bf16 group scales: a relative error of 2^-9 per group at most
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(y.double(), torch.zeros_like(ref))


@pytest.mark.parametrize("kernel", ["blocked", "onednn"])
def test_quant_linear_bias_and_row_independence(kernel, monkeypatch):
    monkeypatch.setenv(kernels.ENV, kernel)
    q = blocks_of(random_weight(32, 64, 4), "Q4_1")
    bias = torch.randn(32)
    layer = QuantLinear(q, dtype=torch.float32, device=torch.device("cpu"), bias=bias)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x) - bias, QuantLinear(q, dtype=torch.float32, device=torch.device("cpu"))(x))


def test_cuda_packing_puts_the_even_column_in_the_high_nibble():
    u = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 4]], dtype=torch.int32)
    packed = pack_int4_for_cuda(u)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x12, 0xF0], [0x78, 0x34]]
    assert _cuda_inner_k_tiles(576) == 4 and _cuda_inner_k_tiles(1152) == 8 and _cuda_inner_k_tiles(96) == 2
    with pytest.raises(ValueError, match="multiple of 32"):
        _cuda_inner_k_tiles(48)


def test_names_and_the_llama_row_permutation():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    heads, rows = 3, 24
    hf = torch.arange(rows)
    # llama.cpp's converter (convert_hf_to_gguf.py LlamaModel.permute)
    file_rows = hf.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    assert torch.equal(file_rows[_unpermute_rows(rows, heads)], hf)


def tiny_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True)


def tiny_state(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named fp32 weights of ``cfg`` (tied embeddings)."""
    state, k = {}, seed
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim

    def w(rows, cols):
        nonlocal k
        k += 1
        return random_weight(rows, cols, k) * 4
    state["model.embed_tokens.weight"] = w(cfg.vocab_size, h)
    state["model.norm.weight"] = 1 + w(1, h)[0]
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            state[f"{p}{name}.weight"] = w(*shape)
        state[f"{p}input_layernorm.weight"] = 1 + w(1, h)[0]
        state[f"{p}post_attention_layernorm.weight"] = 1 + w(1, h)[0]
    return state


def write_gguf(path, cfg: ModelConfig, state: dict[str, np.ndarray], fmt: str, embed_fmt: str) -> None:
    """A llama GGUF as llama.cpp's converter writes one: q/k rows permuted, matrices quantized."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_layers)
    inverse = {v: k for k, v in {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                                 "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}.items()}
    for name, value in state.items():
        if name == "model.embed_tokens.weight":
            gname, kind = "token_embd.weight", embed_fmt
        elif name == "model.norm.weight":
            gname, kind = "output_norm.weight", "F32"
        else:
            _, _, n, *part, _ = name.split(".")
            gname, kind = f"blk.{n}.{inverse['.'.join(part)]}.weight", fmt if value.ndim == 2 else "F32"
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if "attn_q" in gname else cfg.num_kv_heads
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, value.shape[1]).swapaxes(1, 2).reshape(value.shape)
        if kind == "F32":
            writer.add_tensor(gname, np.ascontiguousarray(value, dtype=np.float32))
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gname, quantize(np.ascontiguousarray(value), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("fmt,embed_fmt", [("Q4_1", "Q8_0"), ("Q4_0", "Q4_0"), ("Q8_0", "Q8_0")])
def test_gguf_file_read_back_under_our_names(tmp_path, fmt, embed_fmt):
    cfg = tiny_config()
    state = tiny_state(cfg)
    write_gguf(tmp_path / "m.gguf", cfg, state, fmt, embed_fmt)
    weights = gguf_weights(tmp_path / "m.gguf", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    assert set(weights) == set(state)
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, QuantTensor) and q.fmt == fmt
    assert weights["model.embed_tokens.weight"].fmt == embed_fmt
    for name, value in state.items():  # the file's weights, exactly, in HF row order
        got = as_dense(weights[name])
        if value.ndim == 1:
            assert torch.equal(got, torch.from_numpy(value))
            continue
        kind = embed_fmt if "embed" in name else fmt  # quantizing works row by row: rows commute
        expected = dequantize(quantize(value, GGMLQuantizationType[kind]), GGMLQuantizationType[kind])
        assert torch.equal(got, torch.from_numpy(expected))
    write_native_file(weights, tmp_path / NATIVE_FILE)
    back = _read_native_file(tmp_path / NATIVE_FILE)
    assert set(back) == set(weights)
    for name, value in weights.items():
        assert torch.equal(as_dense(back[name]), as_dense(value))


def test_native_stage_follows_its_dense_twin(tmp_path):
    """A stage on native blocks against one on the same weights dequantized: the logits differ
    by the rounding of the projections' inputs only (to 8 bits a group of 32 on our kernel: up to
    0.24 here on logits up to 5.4; bf16 on oneDNN's: 0.07); the greedy tokens mostly agree."""
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_state(cfg, seed=5), "Q4_1", "Q8_0")
    weights = gguf_weights(tmp_path / "m.gguf", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    native = LlamaStage(cfg, weights)
    dense = LlamaStage(cfg, {k: as_dense(v) for k, v in weights.items()})
    assert isinstance(native.lm_head, QuantLinear) and native.embed_quant is not None
    assert not isinstance(dense.lm_head, QuantLinear)
    tokens = [3, 17, 42, 5, 77, 11, 60, 2]
    outs = []
    for stage in (native, dense):
        kv = stage.new_kv_cache()
        kv.allocate("r")
        outs.append(stage.forward(StageBatch.from_chains(["r"], [tokens], [0], last_logits_only=False), kv))
    assert outs[0].shape == (len(tokens), cfg.vocab_size)
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.3)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.75


@pytest.mark.real_model
def test_weights_modes_resolve(real_checkpoint, tiny_checkpoint):
    assert resolve_weights("auto", real_checkpoint) == "native"  # the embedded model is a Q4_1 GGUF
    assert resolve_weights("auto", real_checkpoint, device="cuda", dtype="float32") == "dense"
    assert resolve_weights("auto", real_checkpoint, device="cuda", dtype="bfloat16") == "native"
    assert resolve_weights("dense", real_checkpoint) == "dense"
    assert resolve_weights("auto", tiny_checkpoint) == "dense"  # a Hugging Face directory
    with pytest.raises(ValueError, match="needs a GGUF model"):
        resolve_weights("native", tiny_checkpoint)
    with pytest.raises(ValueError, match="use auto, dense, native"):
        resolve_weights("int3", real_checkpoint)
