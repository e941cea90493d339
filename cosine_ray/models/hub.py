"""Hugging Face Hub ids: ``org/name`` (a model repository) or ``org/name/FILE.gguf`` (one GGUF
file of one), fetched through ``huggingface_hub`` into its own cache, where the models of
transformers, vLLM and Ray Serve LLM users already live (``HF_HOME`` / ``HF_HUB_CACHE``, or
``download_dir``), with its progress bars, ``HF_TOKEN`` for gated and private repositories and
``HF_HUB_OFFLINE=1`` for the cache alone.

A repository is fetched in two trips: ``config.json`` first, so that an architecture we do not
run is refused before gigabytes of weights come down, then what a checkpoint needs
(``SNAPSHOT_PATTERNS``: configs, tokenizer files, chat templates, ``*.safetensors``). Every
failure is a one-line ``ModelLoadError``: no such repository, gated or unauthorized, no such
revision or file, offline and not cached, the Hub unreachable.

``cosine_ray.models.loader.resolve_checkpoint`` decides what is a Hub id (a spec that is no
existing path) and reads the fetched directory.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .checkpoint import ModelLoadError, _one_line

__all__ = ["SNAPSHOT_PATTERNS", "TOKENIZER_PATTERNS", "hub_file", "hub_snapshot", "parse_hub_id"]

_REPO = r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}"
HUB_REPO = re.compile(rf"^{_REPO}$")
HUB_GGUF = re.compile(rf"^({_REPO})/([^\s]+\.gguf)$", re.IGNORECASE)
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "*.tiktoken", "chat_template.json",
                      "*.jinja")
"""The tokenizer's files (and its chat template, which newer repositories keep beside it)."""
SNAPSHOT_PATTERNS = ("config.json", "generation_config.json", "model.safetensors.index.json", "*.safetensors",
                     *TOKENIZER_PATTERNS)
"""What a checkpoint needs from a repository: never ``*.bin``, ``*.gguf``, ONNX or other formats."""
OFFLINE_ENV = "HF_HUB_OFFLINE"


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repository, GGUF file in it or None) when ``spec`` has the form of a Hub id, else None.
    Whether it is one is for the caller to decide (a local path of the same form wins)."""
    if spec.startswith((".", "~", "/")) or "\\" in spec or "//" in spec:
        return None
    gguf = HUB_GGUF.match(spec)
    if gguf:
        return gguf.group(1), gguf.group(2)
    return (spec, None) if HUB_REPO.match(spec) else None


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now: huggingface_hub reads it once,
    at import; a process that sets it later (a test, a notebook) is obeyed here too."""
    from huggingface_hub import constants
    now = os.environ.get(OFFLINE_ENV) or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or (now or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir(download_dir: str | os.PathLike[str] | None) -> Path:
    """Where the Hub's files go: ``download_dir``, else huggingface_hub's cache (``HF_HUB_CACHE``,
    or ``HF_HOME``/hub, as set now)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def hub_file(repo_id: str, filename: str, *, revision: str | None = None,
             download_dir: str | os.PathLike[str] | None = None) -> Path:
    """One file of a repository, from the cache or downloaded into it (with a progress bar)."""
    from huggingface_hub import hf_hub_download
    with _hub_errors(repo_id, revision, download_dir, filename):
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir(download_dir),
                                    local_files_only=offline()))


def hub_snapshot(repo_id: str, patterns: tuple[str, ...] = SNAPSHOT_PATTERNS, *, revision: str | None = None,
                 download_dir: str | os.PathLike[str] | None = None) -> Path:
    """The repository's snapshot directory holding the files that match ``patterns``, from the
    cache or downloaded into it (huggingface_hub's progress bars)."""
    from huggingface_hub import snapshot_download
    with _hub_errors(repo_id, revision, download_dir):
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(download_dir),
                                      allow_patterns=list(patterns), local_files_only=offline()))


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, download_dir, filename: str | None = None) -> Iterator[None]:
    """huggingface_hub's exceptions as one ``ModelLoadError`` line each."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of a fetch is the user's one line
        raise ModelLoadError(_message(exc, repo_id, revision, download_dir, filename)) from None


def _message(exc: Exception, repo: str, revision: str | None, download_dir, filename: str | None) -> str:
    from huggingface_hub import errors

    url = f"https://huggingface.co/{repo}"
    at = f" at revision {revision!r}" if revision else ""
    label = repo if filename in (None, "config.json") else f"{repo}/{filename}"
    what = f"model {label!r}{at}"
    if isinstance(exc, errors.GatedRepoError):
        return (f"{what} is gated on the Hugging Face Hub: accept its terms at {url} and set HF_TOKEN "
                f"to a token of that account")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"model {repo!r}: no such repository on the Hugging Face Hub, or a private one this "
                f"HF_TOKEN cannot read (check the id, or set HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"model {repo!r} has no revision {revision!r} on the Hugging Face Hub"
    if isinstance(exc, errors.HfHubHTTPError) and getattr(exc.response, "status_code", None) in (401, 403):
        return f"{what}: the Hugging Face Hub refused access ({exc.response.status_code}); set HF_TOKEN"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        where = cache_dir(download_dir)
        if offline():
            return (f"{what} is not in the Hugging Face cache {where} and HF_HUB_OFFLINE=1 forbids "
                    f"downloading it; download it once online, or unset HF_HUB_OFFLINE")
        return (f"{what} is not in the Hugging Face cache {where} and the Hub cannot be reached: "
                f"{_one_line(exc.__cause__ or exc)[:200]}")
    if isinstance(exc, errors.EntryNotFoundError):
        return f"model {repo!r}: the repository has no file {filename!r}{at}"
    if isinstance(exc, errors.HFValidationError):
        return f"model {repo!r} is not a valid Hugging Face Hub id: {_one_line(exc)[:200]}"
    if isinstance(exc, OSError):
        return f"cannot fetch {what} into {cache_dir(download_dir)}: {exc.strerror or _one_line(exc)}"
    return f"cannot fetch {what} from the Hugging Face Hub: {type(exc).__name__}: {_one_line(exc)[:200]}"
