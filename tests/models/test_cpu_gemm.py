"""Our CPU projection kernels (``models.kernels``: ``gemm``, ``qgemm``), fp32 and GGUF blocks:
products equal to float64's within fp32 rounding, every row's result bit for bit the same
whatever the other rows, the thread count or the tile that computed it, and a clean fallback to
oneDNN (PyTorch's int4 kernel for GGUF weights) where they cannot be built."""

from __future__ import annotations

import pytest
import torch

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cosine_ray.models import kernels, linear
from cosine_ray.models.kernels import build
from cosine_ray.models.linear import QuantLinear
from cosine_ray.models.weights.quant import FORMATS, K_FORMATS, QuantTensor

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built here")

GROUP_FORMATS = sorted(set(FORMATS) - set(K_FORMATS))
"""The formats of 32-weight blocks, which ``gguf`` quantizes (the K formats: ``test_k_quants``)."""

SHAPES = [(1, 576, 960), (3, 576, 49), (17, 1536, 576), (64, 40, 100), (9, 7, 33), (130, 64, 32)]
"""(rows, in, out): the model's shapes and ragged ones (out not a multiple of 32, odd in)."""


def product(rows: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    return x, w, b


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_equal_float64_within_fp32_rounding(rows, k, n, with_bias):
    x, w, b = product(rows, k, n)
    bias = b if with_bias else None
    y = kernels.linear(x, kernels.pack(w), n, None if bias is None else kernels.pad_bias(bias))
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # a sequential fp32 sum over k: |error| <= k * eps * sum |x w|, far below this bound
    bound = 8 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t() + 1)
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_a_row_is_the_same_alone_in_any_batch_and_on_any_thread_count(rows, k, n):
    """Row invariance: what a verify step or a batch computes for a row is bit for bit what a
    one-row decode step computes for it (the tiles of 8, 4, 2 and 1 rows sum alike)."""
    x, w, _ = product(rows, k, n, seed=1)
    packed = kernels.pack(w)
    whole = kernels.linear(x, packed, n)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.linear(x, packed, n), whole)
    finally:
        torch.set_num_threads(threads)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.linear(x[i:i + 1], packed, n)[0], whole[i])
    for start, stop in ((0, min(rows, 5)), (rows // 3, rows)):
        assert torch.equal(kernels.linear(x[start:stop], packed, n), whole[start:stop])


def test_strided_rows_and_leading_dimensions():
    x, w, _ = product(12, 64, 96, seed=2)
    packed = kernels.pack(w)
    wide = torch.randn(12, 100)
    wide[:, 10:74] = x  # rows with a stride of 100
    assert torch.equal(kernels.linear(wide[:, 10:74], packed, 96), kernels.linear(x, packed, 96))
    assert kernels.linear(x.view(3, 4, 64), packed, 96).shape == (3, 4, 96)
    assert kernels.linear(x[:0], packed, 96).shape == (0, 96)


def test_pack_round_trips():
    _, w, _ = product(1, 33, 70, seed=3)
    packed = kernels.pack(w)
    assert packed.shape == (3, 33, 32) and torch.equal(kernels.unpack(packed, 70), w)


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_projection_kernels_agree_and_report_their_weight(kernel, monkeypatch):
    monkeypatch.setenv(kernels.ENV, kernel)
    x, w, b = product(5, 64, 80, seed=4)
    proj = linear.DenseLinear(w, b)
    assert (proj.blocked is not None) == (kernel == "blocked")
    assert linear.projection_kernel("cpu") == kernel or (kernel == "onednn" and not linear.onednn_available())
    torch.testing.assert_close(proj(x), x @ w.t() + b, atol=1e-5, rtol=0)
    torch.testing.assert_close(proj.weight(), w, atol=1e-6, rtol=0)


def test_half_precision_weights_stay_off_the_fp32_kernel(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "blocked")
    proj = linear.DenseLinear(torch.randn(64, 32).to(torch.bfloat16))
    assert proj.blocked is None


def test_without_a_compiler_projections_fall_back_to_onednn(monkeypatch, tmp_path):
    """No C compiler (or a failed build): the kernel reports unavailable and ``blocked``, the
    default, builds oneDNN (or MKL) projections instead of failing."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("COSINE_RAY_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    build.library.cache_clear()
    try:
        assert not kernels.available()
        monkeypatch.setenv(kernels.ENV, "blocked")
        assert linear.projection_kernel("cpu") in ("onednn", "mkl")
        x, w, _ = product(3, 32, 40, seed=5)
        proj = linear.DenseLinear(w)
        assert proj.blocked is None
        torch.testing.assert_close(proj(x), x @ w.t(), atol=1e-5, rtol=0)
    finally:
        monkeypatch.undo()
        build.library.cache_clear()
    assert kernels.available()


def test_an_unknown_kernel_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="COSINE_RAY_CPU_GEMM"):
        linear.projection_kernel("cpu")


# ---- GGUF blocks ------------------------------------------------------------------------------

def quant_weight(fmt: str, n: int, k: int, seed: int) -> QuantTensor:
    w = np.random.default_rng(seed).normal(0.0, 0.05, (n, k)).astype(np.float32)
    return QuantTensor(fmt, torch.from_numpy(np.ascontiguousarray(quantize(w, GGMLQuantizationType[fmt]))), k)


def pack(q: QuantTensor) -> kernels.BlockedQuant:
    return kernels.pack_quant(q.fmt, *q._fields())


QUANT_SHAPES = [(1, 576, 960), (3, 64, 49), (9, 1536, 64), (17, 96, 100)]


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
@pytest.mark.parametrize("rows,k,n", QUANT_SHAPES)
def test_quant_products_are_the_files_weights_times_the_rounded_rows_within_fp32_rounding(fmt, rows, k, n):
    q = quant_weight(fmt, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    y = kernels.linear_quant(x, pack(q))
    w, xr = q.dequantize().double(), kernels.round_rows(x).double()
    exact = xr @ w.t()
    bound = 8 * k * torch.finfo(torch.float32).eps * (xr.abs() @ w.abs().t() + 1)
    assert y.shape == (rows, n) and ((y.double() - exact).abs() <= bound).all()
    # and the rounding is 8 bits a group, not more: the rows themselves are within 1/254 of a group's max
    groups = x.view(rows, -1, 32).abs().amax(-1, keepdim=True)
    assert ((kernels.round_rows(x) - x).view(rows, -1, 32).abs() <= groups / 254 * 1.001).all()


def call_quant(x: torch.Tensor, packed: kernels.BlockedQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """``cr_linear_q`` on x: the product and the scratch it left."""
    rows, k = x.shape
    y, scratch = torch.empty(rows, packed.out_features), kernels.quant_scratch(rows, k)
    build.library().cr_linear_q(x.data_ptr(), k, packed.codes.data_ptr(), packed.kind, packed.scales.data_ptr(),
                                None if packed.mins is None else packed.mins.data_ptr(), None, None, y.data_ptr(),
                                packed.out_features, rows, packed.out_features, k, scratch.data_ptr(), 2)
    return y, scratch


def test_the_kernel_rounds_rows_as_round_rows_says():
    """The 8-bit rows the C code left in its scratch are ``round_rows``'s, code for code (ties
    included: x at exact half steps), with the same scales."""
    rows, k = 5, 96
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    x[0, :32] = torch.arange(32) - 15.5  # max 16.5 ... ; and ties below
    x[1, :32] = torch.linspace(-127, 127, 32) / 127 * 2.5
    x[2, 32:64] = 0  # a group of zeros: scale 0, codes 0
    _, scratch = call_quant(x, pack(quant_weight("Q8_0", 32, k, 1)))
    groups = rows * k // 32
    sx, sq = scratch[:groups].view(rows, -1), scratch[groups:2 * groups].view(rows, -1)
    xq = scratch[2 * groups:2 * groups + rows * k // 4].view(torch.int8).view(rows, k)
    s = x.view(rows, -1, 32).abs().amax(-1) / 127
    assert torch.equal(sx, s)
    expected = torch.round(x.view(rows, -1, 32) * torch.where(s > 0, 1 / s, 0).unsqueeze(-1))
    assert torch.equal(xq.float(), expected.view(rows, k)) and torch.equal(sq, expected.sum(-1))
    assert torch.equal(kernels.round_rows(x), (expected * s.unsqueeze(-1)).view(rows, k))


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)])
def test_the_fp32_products_do_not_depend_on_the_vector_width(flags, tmp_path):
    """The library built without AVX-512 (8-lane tiles of at most 2 rows), or without AVX2 too,
    gives every fp32 product bit for bit: each column is one lane's chain of fused multiply-adds
    over k at any width. (Where the CPU lacks one, that build is the library in use.)"""
    from pathlib import Path
    lib = tmp_path / "narrow.so"
    build.compile_library(lib, "cc", Path(torch.__file__).parent / "lib", flags)
    for rows, k, n in SHAPES:
        x, w, b = product(rows, k, n, seed=5)
        packed, bias = kernels.pack(w), kernels.pad_bias(b)
        assert torch.equal(kernels.linear(x, packed, n, bias, lib=build.load(lib)),
                           kernels.linear(x, packed, n, bias))


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
@pytest.mark.parametrize("flags", [("-mno-avx512vnni", "-mno-avxvnni"), ("-mno-avx512f",), ("-mno-avx2",)])
def test_the_integer_sums_do_not_depend_on_the_instruction_set(fmt, flags, tmp_path):
    """The library built without VNNI (plain C integer loops), without AVX-512 (AVX2's 8-lane
    quarters, vpmaddubsw sums), or without AVX2 either (plain C again, the scales widened from
    fp16 by their bits), gives every product bit for bit."""
    from pathlib import Path
    lib = tmp_path / "plain.so"
    build.compile_library(lib, "cc", Path(torch.__file__).parent / "lib", flags)
    packed = pack(quant_weight(fmt, 100, 576, seed=2))
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(4))
    assert torch.equal(kernels.linear_quant(x, packed, lib=build.load(lib)), kernels.linear_quant(x, packed))


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
@pytest.mark.parametrize("rows,k,n", QUANT_SHAPES)
def test_quant_rows_are_the_same_alone_in_any_batch_and_on_any_thread_count(fmt, rows, k, n):
    packed = pack(quant_weight(fmt, n, k, seed=7))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8))
    whole = kernels.linear_quant(x, packed)
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.linear_quant(x, packed), whole)
    finally:
        torch.set_num_threads(threads)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.linear_quant(x[i:i + 1], packed)[0], whole[i])
    assert torch.equal(kernels.linear_quant(x[rows // 3:], packed), whole[rows // 3:])


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
def test_every_split_of_rows_into_tiles_gives_a_row_its_bits(fmt):
    """1 to 13 rows go in tiles of 1 to 6 rows (9 rows: 5 + 4; 13: 5 + 4 + 4): whichever tile
    computed a row, its product is the one the row gets alone."""
    packed = pack(quant_weight(fmt, 64, 96, seed=5))
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([kernels.linear_quant(x[i:i + 1], packed) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(kernels.linear_quant(x[:rows], packed), alone[:rows]), rows


def test_quant_layout_halves_the_4_bit_codes():
    q4, q8 = pack(quant_weight("Q4_1", 64, 96, 1)), pack(quant_weight("Q8_0", 64, 96, 1))
    assert q4.kind == kernels.QUANT_KINDS["Q4_1"] and q4.codes.shape == (2, 48, 32) and q4.mins is not None
    assert q8.kind == kernels.QUANT_KINDS["Q8_0"] and q8.codes.shape == (2, 96, 32) and q8.mins is None
    assert q4.nbytes == 64 * 48 + 2 * 64 * 3 * 2  # fp16 scales and mins, as in the file


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_quant_linear_takes_the_kernel_chosen(kernel, monkeypatch):
    monkeypatch.setenv(kernels.ENV, kernel)
    layer = QuantLinear(quant_weight("Q4_0", 64, 64, 2), dtype=torch.float32, device=torch.device("cpu"))
    assert (layer.blocked is not None) == (kernel == "blocked")
    assert (layer.packed is not None) == (kernel != "blocked")
