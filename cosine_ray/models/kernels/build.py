"""The kernel library: compiled once per machine, loaded with ctypes, and where it is used.

Every ``*.c`` file of this package goes into one shared library, in one compiler call (``$CC``
or ``cc``, ``-O3 -march=native -fopenmp``), cached in ``cache_root()/kernels`` under a key of
the sources, the compiler and this CPU, and linked against PyTorch's own ``libgomp`` so that the
kernels and PyTorch share one OpenMP runtime. Without a compiler, or where the build fails,
``available()`` is False and the projections stay on oneDNN (``models.linear``); the reason is
logged once. ``load`` declares the entry points' signatures as ``kernels.h`` states them.
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

logger = logging.getLogger(__name__)

ENV = "COSINE_RAY_CPU_GEMM"
"""``blocked`` (default: these kernels, where they build), ``onednn`` or ``mkl``: the kernel of
the CPU projections (``mkl`` and ``onednn`` send GGUF weights to PyTorch's int4 kernel)."""
KERNELS = ("blocked", "onednn", "mkl")
FUSED_ENV = "COSINE_RAY_FUSED_LAYERS"
"""``0`` keeps a CPU layer's norms, RoPE, MLP activation and attention as PyTorch operations (to
compare); by default they run in this library around its projections."""

_HERE = Path(__file__).parent
SOURCES = tuple(sorted(_HERE.glob("*.c")))
"""The families, one a file: gemm, qgemm (and qround, its rounding of the rows), layer, attention, stage."""
_DIGESTED = SOURCES + tuple(sorted(_HERE.glob("*.h")))

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Proj(ctypes.Structure):
    """``cr_proj`` of ``kernels.h``: one projection of a layer."""

    _fields_ = [("kind", _I), ("N", _I), ("K", _I), ("weight", _P), ("d", _P), ("m", _P), ("sub", _P), ("bias", _P),
                ("next", _P)]


_PROJ, _INT = ctypes.POINTER(Proj), ctypes.c_int


class Layer(ctypes.Structure):
    """``cr_layer`` of ``kernels.h``: one layer of a ``cr_stage_layers`` call."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _PROJ), ("o", _PROJ), ("gate_up", _PROJ),
                ("down", _PROJ)]


_SIGNATURES = {
    "cr_linear_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _INT],
    "cr_linear_q": [_P, _I, _P, _INT, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _INT],
    "cr_layer_pre": [_P, _I, _I, _P, _F, _PROJ, _P, _P, _I, _I, _P, _P, _P, _INT],
    "cr_layer_post": [_P, _I, _I, _P, _PROJ, _P, _F, _PROJ, _PROJ, _P, _P, _P, _P, _INT],
    "cr_attend_rows": [_P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _F, _P, _I, _P, _I, _INT,
                       _P, _I, _P, _I, _I, _P],
    "cr_stage_layers": [_P, _I, _I, _P, _I, _F, _P, _P, _I, _I, _I, _F, _P, _I, _P, _P, _P, _I, _P, _I, _P,
                        _P, _P, _P, _P, _P, _P, _P, _INT],
}


def choice() -> str:
    """``COSINE_RAY_CPU_GEMM``, checked."""
    value = os.environ.get(ENV, "blocked").strip().lower()
    if value not in KERNELS:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(KERNELS)}")
    return value


def available() -> bool:
    """The library is built (or was built before) and loads on this machine."""
    return library() is not None


def used_on(device: torch.device | str) -> bool:
    """Projections built now on ``device`` use these kernels (fp32 and GGUF weights; the CPU only)."""
    return torch.device(device).type == "cpu" and choice() == "blocked" and available()


def fused_on(device: torch.device | str, dtype: torch.dtype | str = torch.float32) -> bool:
    """A stage built now on ``device`` in ``dtype`` runs its layers' small operations and the
    attention of all its query rows here (``FusedLayer``, ``attend_rows``): in fp32 where the
    kernels are used, unless ``COSINE_RAY_FUSED_LAYERS=0``."""
    fp32 = dtype in (torch.float32, "float32")
    return fp32 and used_on(device) and os.environ.get(FUSED_ENV, "1").strip() != "0"


@functools.cache
def source_digest() -> str:
    """8 hex digits of the sources: a latency profile measured on one version of the kernels is
    not reused by another (``engine.profile.profile_path``)."""
    digest = hashlib.sha256()
    for path in _DIGESTED:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:8]


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


def compile_library(out: Path, compiler: str, torch_lib: Path, flags: tuple[str, ...] = ()) -> None:
    """Every source into the shared library ``out``; flags: more compiler flags (the tests build
    copies without VNNI, without AVX-512 and without AVX2)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", *map(str, SOURCES),
               "-o", str(staged), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(staged, out)  # atomic: concurrent builders (Ray workers) never load a torn file


def load(path: Path) -> ctypes.CDLL:
    """A built library with its entry points' signatures declared."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """This machine's library, built on first use; None where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("kernels: no C compiler found; fp32 projections stay on oneDNN")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source_digest(), compiler, version, _cpu_signature(),
                                        str(torch_lib), torch.__version__]).encode()).hexdigest()[:16]
        out = cache_root() / "kernels" / f"kernels-{key}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            compile_library(out, compiler, torch_lib)
        return load(out)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("kernels: build failed, fp32 projections stay on oneDNN: %s", detail.strip()[-500:])
        return None
