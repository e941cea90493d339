"""A Hugging Face Hub cache written from local files, laid out as ``huggingface_hub`` lays out
what it downloads, so that the real ``huggingface_hub`` (with ``HF_HUB_OFFLINE=1``) finds it:

    <hub>/models--<org>--<name>/blobs/<hash>                  the file's content
    <hub>/models--<org>--<name>/snapshots/<commit>/<path>     -> ../../blobs/<hash> (relative link)
    <hub>/models--<org>--<name>/refs/<branch or tag>          the commit, no newline

A blob is named by the file's git object id: the SHA-256 of its content for the files the Hub
keeps in LFS (weights, GGUF), the git blob SHA-1 for the others. Large blobs are hard links to
the source where the file system allows it (the embedded model's 540 MB of weights, once).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Mapping

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja")
"""The embedded model's converted files that its Hub repository also has."""


def repo_dir(hub: Path, repo_id: str) -> Path:
    return hub / ("models--" + repo_id.replace("/", "--"))


def blob_id(path: Path) -> str:
    if path.suffix in LFS_SUFFIXES:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def commit_id(label: str) -> str:
    """A 40-hex commit id, fixed for ``label``."""
    return hashlib.sha1(label.encode()).hexdigest()


def write_hub_cache(hub: Path, repo_id: str, files: Mapping[str, Path], *, commit: str | None = None,
                    refs: tuple[str, ...] = ("main",)) -> Path:
    """``files`` (path in the repository -> local source) cached as ``repo_id`` at ``commit``,
    which each of ``refs`` points to; returns the snapshot directory."""
    root = repo_dir(hub, repo_id)
    commit = commit or commit_id(repo_id)
    snapshot = root / "snapshots" / commit
    for name, source in files.items():
        blob = root / "blobs" / blob_id(Path(source))
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            try:
                os.link(source, blob)
            except OSError:
                shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


def write_checkpoint_cache(hub: Path, repo_id: str, model_dir: Path, names: tuple[str, ...] | None = None,
                           **kwargs) -> Path:
    """A model directory's files (``names``, default: every file but our conversion marker and
    locks) cached as ``repo_id``."""
    chosen = names or tuple(sorted(p.name for p in model_dir.iterdir()
                                   if p.is_file() and not p.name.startswith(".")
                                   and p.name not in ("cosine_ray_checkpoint.json", "native.safetensors")))
    return write_hub_cache(hub, repo_id, {n: model_dir / n for n in chosen}, **kwargs)
