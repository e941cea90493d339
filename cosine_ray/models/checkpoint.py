"""A resolved model checkpoint: :class:`Checkpoint` (a Hugging Face model directory and its
architecture; reads its weights, tokenizer, transformers' config and reference model) and
:class:`ModelLoadError`, the one-line error every loading step raises.

``cosine_ray.models.loader.resolve_checkpoint`` turns a model spec into a Checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ModelConfig

_TOKENIZERS_BACKEND = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values that name transformers' plain ``tokenizers``-backed class."""

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Checkpoint", "ModelLoadError", "has_tokenizer_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""Any of these in a directory: it holds a tokenizer."""


def has_tokenizer_files(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


class ModelLoadError(ValueError):
    """A model spec cannot be resolved or loaded; the message says what to do (one line)."""


@dataclass
class Checkpoint:
    """A Hugging Face model directory and its architecture."""

    name: str
    """The model's name: what the server reports as its id unless told another."""
    path: Path
    """The model directory (config.json, weights, and by default the tokenizer)."""
    config: ModelConfig
    tokenizer_path: Path | None = None
    """Where the tokenizer's files are when not in ``path`` (``--tokenizer``)."""
    _hf_config: Any = field(default=None, repr=False)

    @property
    def tokenizer_dir(self) -> Path:
        """The directory the tokenizer is loaded from."""
        return self.tokenizer_path or self.path

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
        return has_tokenizer_files(self.tokenizer_dir)

    def load_tokenizer(self):
        """The tokenizer ``AutoTokenizer.from_pretrained(self.tokenizer_dir)`` gives. Where
        tokenizer_config.json names transformers' plain ``tokenizers`` backend, that class is
        loaded directly: the same tokenizer without AutoTokenizer's model registry, which imports
        torch (2-3 s of CPU in the OpenAI ingress, which needs no tensors)."""
        if not self.has_tokenizer:
            raise ModelLoadError(f"{self.tokenizer_dir} has no tokenizer files (tokenizer.json, ...); "
                                 f"use a model directory that includes its tokenizer, or name one with --tokenizer")
        where = str(self.tokenizer_dir)
        if (self.tokenizer_dir / "tokenizer.json").is_file() and self._tokenizer_class() in _TOKENIZERS_BACKEND:
            try:
                from transformers.tokenization_utils_tokenizers import TokenizersBackend
            except ImportError:  # transformers 4: no such module, AutoTokenizer below
                pass
            else:
                return TokenizersBackend.from_pretrained(where)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(where)

    def _tokenizer_class(self) -> str | None:
        try:
            return json.loads((self.tokenizer_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            return None

    def load_hf_model(self, **kwargs: Any):
        """transformers ``AutoModelForCausalLM`` in fp32, eval mode (reference for tests)."""
        import torch
        from transformers import AutoModelForCausalLM
        kwargs.setdefault("dtype", torch.float32)
        out = AutoModelForCausalLM.from_pretrained(str(self.path), **kwargs)
        if isinstance(out, tuple):  # output_loading_info=True
            return (out[0].eval(), *out[1:])
        return out.eval()


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (s[:300] + "...") if len(s) > 300 else (s or type(e).__name__)
