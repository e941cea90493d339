"""GGUF → safetensors, cached: dequantize a ``.gguf`` with transformers once into a plain
Hugging Face directory (``config.json`` + ``model.safetensors`` + tokenizer files) under
``cache_root()/models``, built in a staging directory under a file lock and renamed into place
atomically; ``_MARKER``, written last, marks a finished conversion.

Which ``.gguf`` goes under which cache key is decided by ``cosine_ray.models.loader``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import ModelLoadError, _one_line
from .config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CACHE_ENV", "cache_root"]


CACHE_ENV = "COSINE_RAY_CACHE"
_CACHE_FORMAT = 1
_MARKER = "cosine_ray_checkpoint.json"
"""Written last into a converted directory: its presence means the conversion finished."""


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------

def cache_root() -> Path:
    """``$COSINE_RAY_CACHE`` or ``~/.cache/cosine_ray``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cosine_ray"


def _models_dir(root: Path) -> Path:
    return root / "models"


def _is_complete(d: Path) -> bool:
    if not (d / _MARKER).is_file() or not (d / "config.json").is_file():
        return False
    try:
        with open(d / _MARKER) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return meta.get("format") == _CACHE_FORMAT and (d / "model.safetensors").is_file()


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:64]
    return f"gguf-{stem}-{h}"


def _build_cached(target: Path, convert) -> None:
    """Run ``convert(staging_dir)`` under a file lock and atomically rename staging to target."""
    from filelock import FileLock, Timeout

    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the cache directory {parent} ({e.strerror}); set "
                             f"{CACHE_ENV} to a writable directory") from None
    lock = FileLock(str(parent / f".{target.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"cosine_ray: waiting for another process converting {target.name} into {target}",
              file=sys.stderr, flush=True)
        lock.acquire()
    try:
        if _is_complete(target):  # another process finished while we waited
            return
        # Leftovers of killed conversions: nobody else writes them while we hold the lock
        # ("~" never occurs in a cache key, so other keys' staging dirs do not match).
        for stale in parent.glob(f".tmp-{target.name}~*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}~", dir=parent))
        try:
            meta = convert(staging)
            with open(staging / _MARKER, "w") as f:
                json.dump({"format": _CACHE_FORMAT, "created": time.time(), **meta}, f, indent=1)
            _make_readable(staging)
            if target.exists():  # incomplete or outdated copy
                old = parent / f".tmp-{target.name}~old-{os.getpid()}"
                os.rename(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        lock.release()


def _make_readable(d: Path) -> None:
    """mkdtemp and safetensors create 0700/0600 entries; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for f in d.iterdir():
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


# --------------------------------------------------------------------------------------------
# GGUF -> safetensors
# --------------------------------------------------------------------------------------------

def _convert_gguf(gguf_path: Path, out_dir: Path, *, what: str, target: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save a plain HF directory in ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    d, name = str(gguf_path.parent), gguf_path.name
    try:
        cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"transformers cannot read the GGUF file {gguf_path}: "
                             f"{_one_line(e)}") from None
    try:
        ModelConfig.from_hf(cfg)
    except ValueError as e:
        raise ModelLoadError(f"{gguf_path}: {e}") from None

    size_mb = gguf_path.stat().st_size / 1e6
    print(f"cosine_ray: converting {what} ({size_mb:.0f} MB GGUF) to safetensors once, cached at "
          f"{target} (~30 s per 100 MB of GGUF)", file=sys.stderr, flush=True)
    # transformers' GGUF reader shows its own bar over the tensors it dequantizes (the slow
    # part); its other bars (the model's weights loaded once more) would only repeat it
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        try:
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot convert the tokenizer of {gguf_path}: "
                                 f"{_one_line(e)}") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot dequantize {gguf_path}: {_one_line(e)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()

    cd = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cd.pop(k, None)
    cd["architectures"] = [type(model).__name__]
    cd["dtype"] = "float32"
    clean = type(model.config).from_dict(cd)
    state = model.state_dict()
    del model
    _save_hf_dir(out_dir, clean, state)
    tok.save_pretrained(str(out_dir))
    # Tokenizer files must not point back at the GGUF.
    tc = out_dir / "tokenizer_config.json"
    if tc.is_file():
        with open(tc) as f:
            tcd = json.load(f)
        if tcd.pop("gguf_file", None) is not None:
            with open(tc, "w") as f:
                json.dump(tcd, f, indent=2, ensure_ascii=False)


def _save_hf_dir(out_dir: Path, hf_config: Any, state: dict[str, "torch.Tensor"]) -> None:
    """config.json + generation_config.json + model.safetensors (tied lm_head dropped)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k == "lm_head.weight" and getattr(hf_config, "tie_word_embeddings", False):
            continue
        tensors[k] = v.detach().to("cpu").contiguous().clone()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out_dir))
    gen = GenerationConfig.from_model_config(hf_config)
    gen.save_pretrained(str(out_dir))
