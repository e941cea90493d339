"""The fp32 CPU projection kernel (``cpu_gemm.c``): built once per machine, loaded with ctypes.

At one row a decode step only reads weights, so its projections should run at the memory
bandwidth; oneDNN's packed fp32 linear ran the embedded model's at ~1.7x that (see
docs/performance-cpu.md). ``cpu_gemm.c`` keeps each weight as 32-column blocks, ``[N/32][K][32]``,
so that at one row every block is one contiguous stream, and sums every output in one fixed
order whatever the number of rows (row-invariant).

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
from pathlib import Path

import torch

from cosine_ray.models.conversion import cache_root

__all__ = ["BLOCK", "available", "linear", "pack", "unpack"]

logger = logging.getLogger(__name__)

BLOCK = 32
"""Output columns per weight block (two 16-lane registers)."""
_SOURCE = Path(__file__).with_name("cpu_gemm.c")
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


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


def _build(out: Path, compiler: str, torch_lib: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(_SOURCE),
               "-o", str(staged), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(staged, out)  # atomic: concurrent builders (Ray workers) never load a torn file


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("cpu_gemm: no C compiler found; fp32 projections stay on oneDNN")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([_SOURCE.read_text(), compiler, version, _cpu_signature(),
                                        str(torch_lib), torch.__version__]).encode()).hexdigest()[:16]
        out = cache_root() / "kernels" / f"cpu_gemm-{key}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _build(out, compiler, torch_lib)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("cpu_gemm: build failed, fp32 projections stay on oneDNN: %s", detail.strip()[-500:])
        return None
    lib.cr_linear_f32.argtypes = _ARGTYPES
    lib.cr_linear_f32.restype = None
    return lib


def available() -> bool:
    """The kernel is built (or was built before) and loads on this machine."""
    return _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight  # [N, K] fp32 -> [ceil(N / 32), K, 32], rows past N zero."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack``: [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, k)[:out_features]


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias  # [N] -> [ceil(N / 32) * 32] fp32, zero past N (the kernel reads whole blocks)."""
    out = torch.zeros(-(-bias.numel() // BLOCK) * BLOCK, dtype=torch.float32)
    out[:bias.numel()] = bias
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x  # [..., K] fp32 -> [..., N] with ``packed`` from ``pack`` and ``bias`` from ``pad_bias``."""
    lib = _library()
    assert lib is not None, "cpu_gemm.linear called where the kernel is not available"
    k = packed.shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    lib.cr_linear_f32(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                      rows.shape[0], out_features, k, torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)
