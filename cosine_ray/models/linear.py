"""A stage's projections, ``y = x W^T (+ b)``, each with its kernel chosen once, at load time.

A dense weight (:class:`DenseLinear`) in fp32 on CPU goes to our own kernels (``models.kernels``)
where they build; otherwise, and in half precision, it is pre-packed for oneDNN; elsewhere (CUDA,
or a dtype oneDNN cannot pack on this CPU) it is kept transposed and applied as ``x @ w_t``. A
GGUF weight (:class:`QuantLinear`) stays quantized: on our kernels on CPU, through PyTorch's int4
kernels elsewhere, where its format has an int4 form (``quant.INT4_FORMATS``); a format without
one is dequantized there, said once in the log. Rows of one projection in different formats (a
layer's q and k in one, v in another, as llama.cpp's ``_M`` files mix them) are a
:class:`StackedLinear`, each part in its own. ``COSINE_RAY_CPU_GEMM`` (``blocked``, the default,
``onednn`` or ``mkl``) picks the CPU kernel; ``projection`` picks the class for a stage's weights.
"""

from __future__ import annotations

import logging
from itertools import groupby
from typing import Sequence

import torch

from cosine_ray.models import kernels
from cosine_ray.models.weights.quant import GROUP, INT4_FORMATS, QuantTensor, as_dense, is_quantized

logger = logging.getLogger(__name__)
_DEQUANTIZED: set[tuple[str, str]] = set()
"""(format, device type) already said to be dequantized."""


def onednn_available() -> bool:
    """This PyTorch build can pre-pack and run oneDNN linear layers on CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def projection_kernel(device: torch.device | str) -> str:
    """The kernel of the fp32 projections stages built now on ``device`` use: ``blocked``,
    ``onednn`` or ``mkl`` on CPU (``COSINE_RAY_CPU_GEMM``; half-precision weights go to oneDNN
    under ``blocked``, and a dtype oneDNN cannot pack on this CPU to MKL, per weight),
    ``default`` elsewhere (``x @ w_t``)."""
    device = torch.device(device)
    if device.type != "cpu":
        return "default"
    if _use_blocked(device, torch.float32):
        return "blocked"
    return "onednn" if _use_onednn(device) else "mkl"


def _native_half_gemm(dtype: torch.dtype) -> bool:
    """This CPU has a native GEMM for ``dtype`` (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16 or AMX)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _use_blocked(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and kernels.used_on(device)


def _use_onednn(device: torch.device) -> bool:
    return kernels.choice() in ("blocked", "onednn") and device.type == "cpu" and onednn_available()


class DenseLinear:
    """One dense projection, ``y = x W^T + b``, in one of four forms.

    - ``blocked``: an fp32 weight on CPU, by default, in 32-column blocks for our kernel
      (``kernels.gemm``: at one row each block is one contiguous stream, and every output is
      summed in one order whatever the rows).
    - ``packed``: where that kernel cannot be built, for half-precision weights, or with
      ``COSINE_RAY_CPU_GEMM=onednn``, the weight pre-packed for oneDNN
      (``torch.ops.mkldnn._reorder_linear_weight``, the layout PyTorch's own frozen CPU graphs use)
      and applied with ``_linear_pointwise``: no re-packing per call, and a JIT kernel for the CPU
      at hand, where MKL picks slow code paths on non-Intel CPUs.
    - ``w_t``: elsewhere (CUDA, or a dtype oneDNN cannot pack on this CPU, e.g. bf16 without
      AVX512-BF16/AVX-NE-CONVERT; ``COSINE_RAY_CPU_GEMM=mkl`` forces it) the weight transposed,
      ``[in, out]``, applied as ``x @ w_t``.
    - ``upcast``: a half-precision weight on a CPU without a native bf16/fp16 GEMM is kept
      transposed *in fp32* and applied as ``(x.float() @ w_t).to(x.dtype)``: the exact fp32 values
      of the weights, accumulated in fp32 and rounded once, what a bf16 GEMM with fp32
      accumulation computes (up to summation order), at fp32 speed for twice bf16's weight
      memory, where PyTorch's own half-precision GEMM on such a CPU is a scalar fallback."""

    __slots__ = ("blocked", "blocked_bias", "packed", "w_t", "bias", "out_features", "upcast")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight  # [out, in] (the checkpoint's layout)"""
        self.bias = bias
        self.out_features = int(weight.shape[0])
        self.blocked: torch.Tensor | None = None
        """fp32 on CPU: [out / 32, in, 32] for ``kernels.gemm`` (the default kernel there)."""
        self.blocked_bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.w_t: torch.Tensor | None = None
        self.upcast = False
        if _use_blocked(weight.device, weight.dtype):
            self.blocked = kernels.pack(weight)
            self.blocked_bias = None if bias is None else kernels.pad_bias(bias)
            return
        if _use_onednn(weight.device):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError:  # dtype this CPU cannot pack
                self.packed = None
        self.upcast = (self.packed is None and weight.device.type == "cpu"
                       and weight.dtype in (torch.bfloat16, torch.float16) and not _native_half_gemm(weight.dtype))
        if self.packed is None:
            self.w_t = (weight.float() if self.upcast else weight).t().contiguous()

    def weight(self) -> torch.Tensor:
        """The weight as the checkpoint holds it, [out, in] (a copy where it is packed)."""
        if self.blocked is not None:
            return kernels.unpack(self.blocked, self.out_features)
        if self.w_t is not None:
            return self.w_t.t()
        eye = torch.eye(int(self.packed.shape[1]), dtype=self.packed.dtype)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            return kernels.linear(x, self.blocked, self.out_features, self.blocked_bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.upcast:
            y = x.float() @ self.w_t
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        if self.bias is None:
            return x @ self.w_t
        return torch.addmm(self.bias, x, self.w_t)


def _cuda_inner_k_tiles(cols: int) -> int:
    for tiles in (8, 4, 2):
        if cols % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"{cols} input columns: the CUDA int4 kernel needs a multiple of 32")


def pack_int4_for_cuda(u: torch.Tensor) -> torch.Tensor:
    """u  # [rows, K] codes 0..15 -> [rows, K / 2] uint8, two codes a byte (even column in the
    high nibble): the input ``_convert_weight_to_int4pack`` takes."""
    return ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)


class QuantLinear:
    """``y = x W^T`` with W a :class:`~cosine_ray.models.weights.quant.QuantTensor`, kept quantized on the device.

    On CPU, by default, through our own kernel (``kernels.qgemm``: the file's codes in 32-column
    blocks, activations rounded to 8 bits a group of 32, each row's result independent of its
    batch). Elsewhere, or with ``COSINE_RAY_CPU_GEMM=onednn|mkl``, through PyTorch's int4
    weight-only kernels in the form ``QuantTensor.int4_affine`` gives: ``_weight_int4pack_mm_for_cpu``
    on CPU and ``_weight_int4pack_mm`` (tinygemm) on CUDA, with bf16 activations and group scales
    (the only fast form of either: the result is cast back to the stage's dtype)."""

    __slots__ = ("fmt", "out_features", "in_features", "packed", "scales_zeros", "device", "compute", "bias",
                 "blocked", "blocked_bias")

    def __init__(self, weight: QuantTensor, *, dtype: torch.dtype, device: torch.device,
                 bias: torch.Tensor | None = None) -> None:
        self.fmt = weight.fmt
        self.out_features, self.in_features = weight.shape
        self.device = torch.device(device)
        self.bias = bias
        self.blocked: kernels.BlockedQuant | None = None
        self.blocked_bias: torch.Tensor | None = None
        self.packed = self.scales_zeros = None
        self.compute = torch.float32
        if kernels.used_on(self.device):
            self.blocked = kernels.pack_quant(weight.fmt, *weight._fields())
            self.blocked_bias = None if bias is None else kernels.pad_bias(bias.float())
            return
        u, s, z = weight.int4_affine()
        # bf16 activations: CUDA's tinygemm takes nothing else, and on CPU the fp32 and fp16 forms
        # of the kernel are scalar loops
        self.compute = torch.bfloat16
        self.scales_zeros = torch.stack([s.t(), z.t()], dim=-1).to(self.device, self.compute).contiguous()  # [K'/32, N, 2]
        if self.device.type == "cuda":
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                pack_int4_for_cuda(u).to(self.device), _cuda_inner_k_tiles(u.shape[1]))
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(self.device), 1)

    @property
    def nbytes(self) -> int:
        """Bytes one multiplication reads: codes and group scales."""
        if self.blocked is not None:
            return self.blocked.nbytes
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x  # [M, in] -> [M, out] in x's dtype."""
        if self.blocked is not None:
            return kernels.linear_quant(x.float(), self.blocked, self.blocked_bias).to(x.dtype)
        xin = x.to(self.compute)
        if self.fmt == "Q8_0":
            xin = torch.cat([xin, xin], dim=-1)  # [M, 2 in]: the high codes, then the low ones
        xin = xin.contiguous()
        if self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(xin, self.packed, GROUP, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xin, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class StackedLinear:
    """One projection whose rows come in parts of different kinds (GGUF formats, or dense), each a
    projection of its own: their outputs side by side, in order."""

    __slots__ = ("parts", "out_features")

    def __init__(self, parts: "list[DenseLinear | QuantLinear]") -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    @property
    def blocked(self) -> bool | None:
        """True where every part runs on our kernels (``kernel_operand``), else None."""
        return True if all(p.blocked is not None for p in self.parts) else None

    @property
    def nbytes(self) -> int:
        """Bytes one multiplication reads (the parts' weights)."""
        return sum(weight_bytes(p) for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


Projection = DenseLinear | QuantLinear | StackedLinear


def weight_bytes(m: Projection) -> int:
    """Bytes one application of ``m`` reads from its weights."""
    if isinstance(m, (QuantLinear, StackedLinear)):
        return m.nbytes
    if m.blocked is not None:
        return m.out_features * m.blocked.shape[1] * 4  # the padding is never read for real rows
    w = m.packed if m.packed is not None else m.w_t
    return w.numel() * w.element_size()


def projection(parts: Sequence[torch.Tensor | QuantTensor], bias: torch.Tensor | None = None, *,
               dtype: torch.dtype, device: torch.device) -> Projection:
    """One projection over the rows of ``parts`` stacked (a checkpoint's q, k and v, say): each run
    of parts in one GGUF format kept quantized in it (``quantized``), dense ones in ``dtype`` on
    ``device``; a :class:`StackedLinear` of the runs where there are several."""
    runs = [list(run) for _, run in groupby(parts, key=lambda p: p.fmt if is_quantized(p) else None)]
    built, start = [], 0
    for run in runs:
        rows = sum(int(p.shape[0]) for p in run)
        part_bias = None if bias is None else bias[start:start + rows]
        start += rows
        if is_quantized(run[0]):
            built.append(quantized(QuantTensor.cat(run), part_bias, dtype=dtype, device=device))
        else:
            built.append(DenseLinear(torch.cat([p.to(device=device, dtype=dtype).contiguous() for p in run]), part_bias))
    return built[0] if len(built) == 1 else StackedLinear(built)


def quantized(weight: QuantTensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype,
              device: torch.device) -> "QuantLinear | DenseLinear":
    """``weight`` kept quantized (our kernels, or an int4 form), or dequantized to ``dtype`` where
    ``device`` has no kernel for its format (said once a format)."""
    device = torch.device(device)
    if kernels.used_on(device) or weight.fmt in INT4_FORMATS:
        return QuantLinear(weight, dtype=dtype, device=device, bias=bias)
    if (weight.fmt, device.type) not in _DEQUANTIZED:
        _DEQUANTIZED.add((weight.fmt, device.type))
        logger.warning("weights native: GGUF %s has no int4 form for PyTorch's kernels on %s: its projections "
                       "are dequantized to %s (the file's weights, at dense speed)", weight.fmt, device.type,
                       str(dtype).removeprefix("torch."))
    return DenseLinear(weight.dequantize().to(device=device, dtype=dtype).contiguous(), bias)


def bf16_activations(m: Projection) -> bool:
    """``m`` rounds its input to bf16 (PyTorch's int4 kernels, on CPU off our kernels)."""
    if isinstance(m, StackedLinear):
        return any(bf16_activations(p) for p in m.parts)
    return isinstance(m, QuantLinear) and m.blocked is None


def kernel_operand(m: Projection) -> "tuple | list[tuple] | None":
    """``m`` as ``kernels.FusedLayer`` takes a projection, (blocks, padded bias or None, N, K) (a
    :class:`StackedLinear`: a list of them, one a part), where it runs on our kernels; None
    elsewhere."""
    if m.blocked is None:
        return None
    if isinstance(m, StackedLinear):
        return [kernel_operand(p) for p in m.parts]
    k = m.in_features if isinstance(m, QuantLinear) else int(m.blocked.shape[1])
    return m.blocked, m.blocked_bias, m.out_features, k
