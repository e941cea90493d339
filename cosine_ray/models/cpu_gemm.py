"""Our CPU projection kernels (``cpu_gemm.c``): built once per machine, loaded with ctypes.

At one row a decode step only reads weights, so its projections should run at the memory
bandwidth (docs/performance-cpu.md). ``cpu_gemm.c`` keeps each weight as 32-column blocks, ``[N/32][K][32]``,
so that at one row every block is one contiguous stream, and sums every output in one fixed
order whatever the number of rows (row-invariant). GGUF weights (``--weights native``) go the same
way, kept quantized: ``pack_quant`` lays a GGUF matrix's codes (``models.quant``) out in the
same 32-column blocks (four k of a column to a 32-bit lane, for VNNI's integer dot products) with
the file's fp16 group scales, and ``linear_quant`` multiplies them with the activations rounded
to 8 bits a group of 32 (``round_rows``, as llama.cpp does). Around the projections the same
library runs a decoder layer's small operations (``FusedLayer``: RMS norms, RoPE, residual adds,
SiLU · up; two calls a layer) and the attention of every query row (``attend_rows``), row by
row: a step is a few dozen C calls instead of ~1,000 small PyTorch operations
(``COSINE_RAY_FUSED_LAYERS=0`` turns this off).

The shared library is compiled on first use with the system C compiler (``$CC`` or ``cc``,
``-O3 -march=native -fopenmp``) into ``cache_root()/kernels`` under a key of the source, the
compiler and this CPU, and linked against PyTorch's own ``libgomp`` so that the kernel and
PyTorch share one OpenMP runtime. Without a compiler, or where the build fails, ``available()``
is False and projections stay on oneDNN (``models.llama._Linear``); the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cosine_ray.models.conversion import cache_root

__all__ = ["BLOCK", "ENV", "KERNELS", "BlockedQuant", "available", "choice", "linear", "linear_quant", "pack",
           "pack_quant", "QUANT_KINDS", "quant_scratch", "round_rows", "unpack", "used_on", "FUSED_ENV", "FusedLayer",
           "FusedStack", "LayerScratch", "attend_rows", "fused_on", "source_digest"]

logger = logging.getLogger(__name__)

BLOCK = 32
"""Output columns per weight block (two 16-lane registers)."""
GROUP = 32
"""Weights per GGUF block along the input dimension."""
FUSED_ENV = "COSINE_RAY_FUSED_LAYERS"
"""``0`` keeps a CPU layer's norms, RoPE, MLP activation and attention as PyTorch operations (to
compare); by default they run in ``cpu_gemm.c`` around our kernels' projections."""
ENV = "COSINE_RAY_CPU_GEMM"
"""``blocked`` (default: these kernels, where they build), ``onednn`` or ``mkl``: the kernel of
the CPU projections (``mkl`` and ``onednn`` send GGUF weights to PyTorch's int4 kernel)."""
KERNELS = ("blocked", "onednn", "mkl")
_SOURCE = Path(__file__).with_name("cpu_gemm.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
_QUANT_ARGTYPES = [_P, _I, _P, ctypes.c_int, _P, _P, _P, _P, _I, _I, _I, _I, _P, ctypes.c_int]
_F = ctypes.c_float


class _Proj(ctypes.Structure):
    """``cr_proj`` of ``cpu_gemm.c``: one projection for ``cr_layer_pre`` / ``cr_layer_post``."""

    _fields_ = [("kind", _I), ("N", _I), ("K", _I), ("weight", _P), ("d", _P), ("m", _P), ("bias", _P)]


_PROJ = ctypes.POINTER(_Proj)
_PRE_ARGTYPES = [_P, _I, _I, _P, _F, _PROJ, _P, _P, _I, _I, _P, _P, _P, ctypes.c_int]
_POST_ARGTYPES = [_P, _I, _I, _P, _PROJ, _P, _F, _PROJ, _PROJ, _P, _P, _P, _P, ctypes.c_int]
_ATTEND_ARGTYPES = [_P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _F, _P, _I, _P, _I, ctypes.c_int,
                    _P, _I, _P, _I, _I, _P]


class _LayerC(ctypes.Structure):
    """``cr_layer`` of ``cpu_gemm.c``: one layer of a ``cr_stage_layers`` call."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _PROJ), ("o", _PROJ), ("gate_up", _PROJ),
                ("down", _PROJ)]


_STAGE_ARGTYPES = [_P, _I, _I, _P, _I, _F, _P, _P, _I, _I, _I, _F, _P, _I, _P, _P, _P, _I, _P, _I, _P,
                   _P, _P, _P, _P, _P, _P, _P, ctypes.c_int]
MAX_HEAD_DIM = 1024
"""``cr_layer_pre`` rotates a head through a stack buffer of this many floats (``MAX_HEAD_DIM`` there)."""
ROW_TILE = 8
"""``cr_attend_rows`` attends up to this many rows of one key list together (``ROW_TILE`` there)."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                if line.strip() == "":  # the first processor is enough
                    break
    except OSError:
        pass
    return f"{platform.machine()}\n{flags}"


def _build(out: Path, compiler: str, torch_lib: Path, flags: tuple[str, ...] = ()) -> None:
    """flags: more compiler flags (the tests build copies without VNNI and without AVX-512)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", str(_SOURCE),
               "-o", str(staged), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(staged, out)  # atomic: concurrent builders (Ray workers) never load a torn file


@functools.cache
def source_digest() -> str:
    """8 hex digits of ``cpu_gemm.c``: a latency profile measured on one version of the kernels is
    not reused by another (``engine.profile.profile_path``)."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:8]


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("cpu_gemm: no C compiler found; fp32 projections stay on oneDNN")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source_digest(), compiler, version, _cpu_signature(),
                                        str(torch_lib), torch.__version__]).encode()).hexdigest()[:16]
        out = cache_root() / "kernels" / f"cpu_gemm-{key}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _build(out, compiler, torch_lib)
        return _load(out)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("cpu_gemm: build failed, fp32 projections stay on oneDNN: %s", detail.strip()[-500:])
        return None


def _load(path: Path) -> ctypes.CDLL:
    """A built library with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.cr_linear_f32.argtypes = _ARGTYPES
    lib.cr_linear_f32.restype = None
    lib.cr_linear_q.argtypes = _QUANT_ARGTYPES
    lib.cr_linear_q.restype = None
    lib.cr_layer_pre.argtypes = _PRE_ARGTYPES
    lib.cr_layer_pre.restype = None
    lib.cr_layer_post.argtypes = _POST_ARGTYPES
    lib.cr_layer_post.restype = None
    lib.cr_attend_rows.argtypes = _ATTEND_ARGTYPES
    lib.cr_attend_rows.restype = None
    lib.cr_stage_layers.argtypes = _STAGE_ARGTYPES
    lib.cr_stage_layers.restype = None
    return lib


def available() -> bool:
    """The kernel is built (or was built before) and loads on this machine."""
    return _library() is not None


def choice() -> str:
    """``COSINE_RAY_CPU_GEMM``, checked."""
    value = os.environ.get(ENV, "blocked").strip().lower()
    if value not in KERNELS:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(KERNELS)}")
    return value


def fused_on(device: torch.device | str, dtype: torch.dtype | str = torch.float32) -> bool:
    """A stage built now on ``device`` in ``dtype`` runs its layers' small operations and the
    attention of all its query rows in ``cpu_gemm.c`` (``FusedLayer``, ``attend_rows``): in fp32
    where the kernels are used, unless ``COSINE_RAY_FUSED_LAYERS=0``."""
    fp32 = dtype in (torch.float32, "float32")
    return fp32 and used_on(device) and os.environ.get(FUSED_ENV, "1").strip() != "0"


def used_on(device: torch.device | str) -> bool:
    """Projections built now on ``device`` use these kernels (fp32 and GGUF weights; the CPU only)."""
    return torch.device(device).type == "cpu" and choice() == "blocked" and available()


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """t  # [N, ...] -> [ceil(N / 32), ..., 32], rows past N zero."""
    n = t.shape[0]
    padded = torch.zeros((-(-n // BLOCK) * BLOCK, *t.shape[1:]), dtype=t.dtype)
    padded[:n] = t
    return padded.view(-1, BLOCK, *t.shape[1:]).movedim(1, -1).contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight  # [N, K] -> [ceil(N / 32), K, 32] fp32, rows past N zero."""
    return _blocks(weight.to(torch.float32))


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack``: [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, k)[:out_features]


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias  # [N] -> [ceil(N / 32) * 32] fp32, zero past N (the kernel reads whole blocks)."""
    return _blocks(bias.to(torch.float32)).reshape(-1)


def _call_parts(lib: ctypes.CDLL | None, x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x  # [..., k] as rows with unit column stride, and their output [rows, n]."""
    assert lib is not None, "cpu_gemm called where the kernel is not available"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, torch.empty(rows.shape[0], n, dtype=torch.float32)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x  # [..., K] fp32 -> [..., N] with ``packed`` from ``pack`` and ``bias`` from ``pad_bias``."""
    return _linear_on(_library(), x, packed, out_features, bias)


def _linear_on(lib: ctypes.CDLL | None, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` through ``lib`` (the tests pass a copy built with other flags)."""
    k = packed.shape[1]
    rows, y = _call_parts(lib, x, k, out_features)
    lib.cr_linear_f32(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                      rows.shape[0], out_features, k, torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)


@dataclass(frozen=True, slots=True)
class BlockedQuant:
    """A GGUF matrix [N, K] laid out for ``cr_linear_q`` (see ``cpu_gemm.c``)."""

    codes: torch.Tensor
    """uint8 [N/32, K/2, 32] (Q4_0, Q4_1: two codes a byte) or [N/32, K, 32] (Q8_0), in the order
    ``cpu_gemm.c`` gives."""
    kind: int
    """``cpu_gemm.c``'s format: ``QUANT_KINDS[fmt]``."""
    scales: torch.Tensor
    """fp16 [N/32, K/32, 32]: d, the file's own."""
    mins: torch.Tensor | None
    """fp16 [N/32, K/32, 32]: m (Q4_1), or None."""
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


QUANT_KINDS = {"Q8_0": 0, "Q4_1": 1, "Q4_0": 2}
"""GGUF formats the kernel multiplies, as ``cpu_gemm.c`` numbers them."""


def _halves(t: torch.Tensor) -> torch.Tensor:
    """t  # [N, K/32] fp32 that came from fp16 -> [N/32, K/32, 32] fp16, the same values."""
    h = t.to(torch.float16)
    if not torch.equal(h.to(t.dtype), t):
        raise ValueError("GGUF scales must be fp16 values")
    return _blocks(h)


def pack_quant(fmt: str, d: torch.Tensor, m: torch.Tensor | None, codes: torch.Tensor) -> BlockedQuant:
    """A GGUF matrix in the kernel's blocks, from its fields (``QuantTensor._fields()``): scales
    and mins [N, K/32] (the file's fp16 values; mins only for Q4_1), codes [N, K] (0..15; int8
    for Q8_0). The same weights, exactly: ``d q + m``, Q4_0 ``d (q - 8)``, Q8_0 ``d q``. The codes
    go in the order ``cpu_gemm.c`` describes: four consecutive k of a column in one 32-bit lane."""
    n, k = codes.shape
    cols = _blocks(codes.view(torch.uint8)).movedim(-1, 1)  # [N/32, 32 n, K]
    nb, groups = cols.shape[0], k // GROUP
    if fmt == "Q8_0":
        lanes = (cols ^ 0x80).reshape(nb, 2, 16, groups, 8, 4)  # [t, h, c, g, kk, j]: code + 128
        laid = lanes.permute(0, 3, 1, 4, 2, 5).contiguous().view(nb, k, BLOCK)
        return BlockedQuant(laid, QUANT_KINDS[fmt], _halves(d), None, n, k)
    halves = cols.reshape(nb, 2, 16, groups, 4, 2, 4)  # [t, h, c, g, kk, low / high, j]
    pairs = halves[..., 0, :] | (halves[..., 1, :] << 4)
    laid = pairs.permute(0, 3, 1, 4, 2, 5).contiguous().view(nb, k // 2, BLOCK)
    return BlockedQuant(laid, QUANT_KINDS[fmt], _halves(d), None if m is None else _halves(m), n, k)


def quant_scratch(rows: int, k: int) -> torch.Tensor:
    """What ``cr_linear_q`` needs beside its operands for ``rows`` rows of width ``k``: the rows
    rounded to 8 bits, their scales and their group sums (10 floats a group)."""
    return torch.empty(max(rows, 1) * (k // GROUP) * 10, dtype=torch.float32)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x  # [M, K] fp32 as the GGUF kernel sees it: each group of 32 rounded to 8 bits with the
    scale max |x| / 127 (round half to even), back in fp32. ``linear_quant(x, w)`` is
    ``round_rows(x) @ w^T`` within fp32 rounding."""
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    s = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return (torch.round(g * inv) * s).reshape(x.shape)


def linear_quant(x: torch.Tensor, weight: BlockedQuant, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x  # [..., K] fp32 -> [..., N] fp32 with ``weight`` from ``pack_quant`` and ``bias`` from
    ``pad_bias``."""
    return _linear_quant_on(_library(), x, weight, bias)


def _linear_quant_on(lib: ctypes.CDLL | None, x: torch.Tensor, weight: BlockedQuant,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_quant`` through ``lib`` (the tests pass a copy built with other flags)."""
    k, n = weight.in_features, weight.out_features
    rows, y = _call_parts(lib, x, k, n)
    scratch = quant_scratch(rows.shape[0], k)
    lib.cr_linear_q(rows.data_ptr(), rows.stride(0), weight.codes.data_ptr(), weight.kind,
                    weight.scales.data_ptr(), None if weight.mins is None else weight.mins.data_ptr(),
                    None if bias is None else bias.data_ptr(), y.data_ptr(), n, rows.shape[0], n, k,
                    scratch.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


# ---- a decoder layer's small operations beside its projections (cr_layer_pre / cr_layer_post) ----

def _proj(weight: "torch.Tensor | BlockedQuant", bias: torch.Tensor | None, n: int, k: int) -> _Proj:
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weight, BlockedQuant):
        return _Proj(1 + weight.kind, n, k, weight.codes.data_ptr(), weight.scales.data_ptr(),
                     None if weight.mins is None else weight.mins.data_ptr(), bias_ptr)
    return _Proj(0, n, k, weight.data_ptr(), None, None, bias_ptr)


class LayerScratch:
    """The buffers one forward's layers share: [rows, hidden] twice, the qkv rows, gate/up and
    the activation, and the GGUF kernel's scratch (``quant_scratch``)."""

    __slots__ = ("h", "qkv", "gu", "act", "xsum")

    def __init__(self, rows: int, hidden: int, qkv: int, inter: int, attn: int) -> None:
        """attn: the o projection's input width (heads × head_dim, which need not be hidden)."""
        self.h = torch.empty(rows, hidden)
        self.qkv = torch.empty(rows, qkv)
        self.gu = torch.empty(rows, 2 * inter)
        self.act = torch.empty(rows, inter)
        self.xsum = quant_scratch(rows, max(hidden, inter, attn))  # any projection's K


class FusedLayer:
    """One decoder layer's norms, RoPE, residual adds and SiLU · up run in ``cpu_gemm.c`` around
    its four projections (each either fp32 blocks from ``pack`` or GGUF blocks from
    ``pack_quant``): two calls a layer instead of some thirty PyTorch operations. The tensors the
    projections point at stay alive in the caller's layer (``models.llama._Layer``)."""

    __slots__ = ("input_norm", "post_norm", "eps", "qkv", "o", "gate_up", "down", "hidden")

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 projections: dict[str, tuple["torch.Tensor | BlockedQuant", torch.Tensor | None, int, int]]) -> None:
        """projections: qkv, o, gate_up and down as (weight, padded bias or None, N, K)."""
        self.input_norm, self.post_norm, self.eps = input_norm.contiguous(), post_norm.contiguous(), float(eps)
        self.qkv, self.o, self.gate_up, self.down = (ctypes.pointer(_proj(*projections[name]))
                                                     for name in ("qkv", "o", "gate_up", "down"))
        self.hidden = projections["qkv"][3]

    def pre(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rot_heads: int, head_dim: int,
            scratch: LayerScratch) -> torch.Tensor:
        """x  # [rows, hidden] fp32 contiguous -> the rows' q, k, v [rows, qkv] (q and k rotated),
        in ``scratch``; cos, signed_sin  # [rows, head_dim] contiguous."""
        _library().cr_layer_pre(x.data_ptr(), x.shape[0], self.hidden, self.input_norm.data_ptr(), self.eps, self.qkv,
                                cos.data_ptr(), signed_sin.data_ptr(), rot_heads, head_dim, scratch.h.data_ptr(),
                                scratch.qkv.data_ptr(), scratch.xsum.data_ptr(), torch.get_num_threads())
        return scratch.qkv

    def post(self, x: torch.Tensor, attn: torch.Tensor, scratch: LayerScratch) -> None:
        """x += the layer's attention output projected, then its MLP, in place; attn  # [rows, heads *
        head_dim] contiguous."""
        _library().cr_layer_post(x.data_ptr(), x.shape[0], self.hidden, attn.data_ptr(), self.o,
                                 self.post_norm.data_ptr(), self.eps, self.gate_up, self.down, scratch.h.data_ptr(),
                                 scratch.gu.data_ptr(), scratch.act.data_ptr(), scratch.xsum.data_ptr(),
                                 torch.get_num_threads())


def _scores(row_keys, threads: int) -> torch.Tensor:
    """``cr_attend_rows``' score buffer for ``row_keys`` (``models.attention.RowKeys``), made once a
    step and kept there for every layer."""
    scores = row_keys.scores
    if scores is None or scores.shape[0] != threads * ROW_TILE:
        scores = row_keys.scores = torch.empty(threads * ROW_TILE, (max(row_keys.max_keys, 1) + 15) // 16 * 16)
    return scores


def attend_rows(q: torch.Tensor, row_keys, kpool: torch.Tensor, vpool: torch.Tensor, scale: float,
                out: torch.Tensor, new: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None) -> None:
    """``cr_attend_rows``: the rows ``row_keys.rows`` of out  # [T, heads * head_dim] from q  # [T,
    heads, head_dim] (rows of any stride, heads packed) over the pool slots ``row_keys``
    (``models.attention.RowKeys``) of kpool, vpool  # [slots, kv_heads, head_dim] contiguous, fp32.
    ``new``: the step's (k, v  # [n, kv_heads, head_dim], rows of any stride, heads packed; slots
    [n] int64), written to the pool first in the same call."""
    _, heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous() and kpool.is_contiguous()
    rows, threads = row_keys.rows, torch.get_num_threads()
    scores = _scores(row_keys, threads)
    k = v = slots = None
    n_new = 0
    if new is not None:
        k, v, slots = new
        n_new = len(slots)
        assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim and k.shape[0] == n_new
        assert slots.dtype == torch.int64 and slots.is_contiguous() and k.shape[1] == kpool.shape[1]
    _library().cr_attend_rows(q.data_ptr(), q.stride(0), rows.data_ptr(), len(rows), row_keys.start.data_ptr(),
                              row_keys.count.data_ptr(), row_keys.keys.data_ptr(), kpool.data_ptr(), vpool.data_ptr(),
                              heads, kpool.shape[1], head_dim, scale, out.data_ptr(), out.stride(0), scores.data_ptr(),
                              scores.shape[1], threads, k.data_ptr() if n_new else None, k.stride(0) if n_new else 0,
                              v.data_ptr() if n_new else None, v.stride(0) if n_new else 0, n_new,
                              slots.data_ptr() if n_new else None)


class FusedStack:
    """A stage's ``FusedLayer`` list run by one ``cr_stage_layers`` call a step: each layer's
    ``pre``, ``attend_rows`` over the step's row keys and ``post``, in order, as the per-layer
    calls would run them (the same bits), without Python between the layers."""

    __slots__ = ("layers", "table", "eps", "heads", "kv_heads", "head_dim")

    def __init__(self, layers: "list[FusedLayer]", heads: int, kv_heads: int, head_dim: int) -> None:
        self.layers = layers  # keeps the projections' structs alive
        self.table = (_LayerC * len(layers))(*(
            _LayerC(l.input_norm.data_ptr(), l.post_norm.data_ptr(), l.qkv, l.o, l.gate_up, l.down) for l in layers))
        self.eps = layers[0].eps
        assert all(l.eps == self.eps for l in layers)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, row_keys,
                 slots: torch.Tensor, pool: torch.Tensor, scale: float, scratch: LayerScratch) -> None:
        """x  # [rows, hidden] fp32 contiguous, updated in place; cos, signed_sin  # [rows, head_dim]
        contiguous; row_keys (``models.attention.RowKeys``) naming every row; slots  # [rows] int64,
        each row's new pool slot; pool  # [layers, 2, slots, kv_heads, head_dim] fp32 contiguous
        (``KVCache.pool``)."""
        rows, threads = x.shape[0], torch.get_num_threads()
        assert x.is_contiguous() and pool.is_contiguous() and pool.dtype == torch.float32
        assert pool.shape[0] == len(self.layers) and pool.shape[3:] == (self.kv_heads, self.head_dim)
        assert len(slots) == rows == len(row_keys.rows) and slots.dtype == torch.int64 and slots.is_contiguous()
        scores = _scores(row_keys, threads)
        attn = torch.empty(rows, self.heads * self.head_dim)
        _library().cr_stage_layers(
            x.data_ptr(), rows, x.shape[1], self.table, len(self.layers), self.eps, cos.data_ptr(),
            signed_sin.data_ptr(), self.heads, self.kv_heads, self.head_dim, scale, row_keys.rows.data_ptr(),
            len(row_keys.rows), row_keys.start.data_ptr(), row_keys.count.data_ptr(), row_keys.keys.data_ptr(),
            scores.shape[1], pool.data_ptr(), pool.shape[2], slots.data_ptr(), scratch.h.data_ptr(),
            scratch.qkv.data_ptr(), scratch.gu.data_ptr(), scratch.act.data_ptr(), attn.data_ptr(),
            scratch.xsum.data_ptr(), scores.data_ptr(), threads)
