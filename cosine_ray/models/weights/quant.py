"""GGUF weights kept quantized: the block formats, reading a GGUF file, and embedding lookups.

Terms. A GGUF *block* holds 32 consecutive weights of one row (along the input dimension K):
``Q4_0`` (fp16 scale d, 4-bit codes q: w = d (q - 8)), ``Q4_1`` (fp16 d and min m: w = d q + m),
``Q8_0`` (fp16 d, int8 codes: w = d q). A :class:`QuantTensor` is a matrix [N, K] of such blocks,
rows in the order of our checkpoint names (``gguf_weights`` reads a file).

Its projections are ``models.linear.QuantLinear``. For PyTorch's int4 weight-only kernels (groups
of 32, affine per group, ``w = (u - 8) s + z`` with u in 0..15) ``int4_affine`` gives the same
weights: Q4_0 and Q4_1 map one to one (s = d, z = m + 8 d for Q4_1); a Q8_0 code q = 16 h + l
splits into two 4-bit codes, so its matrix becomes [N, 2K] with groups (16 d, 0) over h + 8 and
(d, 8 d) over l, and the input is fed twice: the products are exactly the file's weights (powers
of two scale exactly). :class:`QuantEmbedding` dequantizes the rows it looks up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
"""Weights per GGUF block, and the group size of the int4 kernels."""
FORMATS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""Supported block formats and their bytes per block."""


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A matrix [rows, cols] stored as GGUF blocks."""

    fmt: str
    """Q4_0 | Q4_1 | Q8_0."""
    blocks: torch.Tensor
    """[rows, cols / 32 * bytes per block] uint8, the file's bytes."""
    cols: int

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"GGUF format {self.fmt} is not served natively (use {', '.join(FORMATS)})")
        if self.cols % GROUP or self.blocks.shape[1] != self.cols // GROUP * FORMATS[self.fmt]:
            raise ValueError(f"{self.fmt} blocks {tuple(self.blocks.shape)} do not hold {self.cols} columns")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.cols

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def index_rows(self, rows: torch.Tensor) -> "QuantTensor":
        return QuantTensor(self.fmt, self.blocks.index_select(0, rows), self.cols)

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Rows of ``parts`` stacked (one format, one width)."""
        if len({(p.fmt, p.cols) for p in parts}) != 1:
            raise ValueError("only matrices of one format and width stack")
        return QuantTensor(parts[0].fmt, torch.cat([p.blocks for p in parts]), parts[0].cols)

    def _fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(d, m or None, codes): d, m  # [rows, groups] fp32; codes  # [rows, cols] uint8 for
        the 4-bit formats (0..15), int8 for Q8_0."""
        rows, groups = self.blocks.shape[0], self.cols // GROUP
        b = self.blocks.view(rows, groups, FORMATS[self.fmt])
        d = b[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
        if self.fmt == "Q8_0":
            return d, None, b[..., 2:].contiguous().view(torch.int8).reshape(rows, self.cols)
        first = 4 if self.fmt == "Q4_1" else 2
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if self.fmt == "Q4_1" else None
        qs = b[..., first:]  # [rows, groups, 16]: element j in the low nibble, j + 16 in the high one
        codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, self.cols)
        return d, m, codes

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed as the GGUF reference does (d q + m, d (q - 8), d q)."""
        d, m, codes = self._fields()
        rows, groups = d.shape
        q = codes.view(rows, groups, GROUP).float()  # [rows, groups, 32]
        if self.fmt == "Q4_1":
            w = d[..., None] * q + m[..., None]
        elif self.fmt == "Q4_0":
            w = d[..., None] * (q - 8)
        else:
            w = d[..., None] * q
        return w.view(rows, self.cols)

    def int4_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, s, z): u  # [rows, K'] int32 codes 0..15; s, z  # [rows, K' / 32] fp32, with
        ``(u - 8) s + z`` the weights (K' = cols, or 2 cols for Q8_0: high codes, then low)."""
        d, m, codes = self._fields()
        if self.fmt == "Q4_0":
            return codes.int(), d, torch.zeros_like(d)
        if self.fmt == "Q4_1":
            return codes.int(), d, m + 8 * d
        high, low = (codes >> 4) + 8, codes & 15  # q = 16 h + l, h in -8..7, l in 0..15
        u = torch.cat([high, low], dim=1).int()
        return u, torch.cat([16 * d, d], dim=1), torch.cat([torch.zeros_like(d), 8 * d], dim=1)


class QuantEmbedding:
    """Rows of a :class:`QuantTensor` looked up and dequantized exactly."""

    __slots__ = ("weight", "dtype")

    def __init__(self, weight: QuantTensor, *, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = QuantTensor(weight.fmt, weight.blocks.to(device), weight.cols)
        self.dtype = dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids  # [n] -> [n, hidden]"""
        rows = self.weight.index_rows(token_ids.to(self.weight.blocks.device))
        return rows.dequantize().to(self.dtype)


# ---- reading a GGUF file ----------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """Our checkpoint name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for tensors we do not use."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' ``reverse_permute_weights``):
    row i of our matrix is row ``order[i]`` of the file's."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def gguf_weights(path, *, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor | QuantTensor]:
    """Every tensor of a GGUF file under our checkpoint names: float tensors as fp32, the
    formats of ``FORMATS`` as :class:`QuantTensor` (nothing dequantized). Other quantized
    formats raise ValueError naming them."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    out: dict[str, torch.Tensor | QuantTensor] = {}
    unsupported = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = GGMLQuantizationType(t.tensor_type).name
        data = torch.from_numpy(np.array(t.data))
        if kind in FORMATS:
            value: torch.Tensor | QuantTensor = QuantTensor(kind, data, int(t.shape[0]))
        elif kind in ("F32", "F16", "BF16"):
            value = data.float() if kind != "BF16" else data.view(torch.bfloat16).float()
        else:
            unsupported.add(kind)
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in name else num_kv_heads
            order = _unpermute_rows(value.shape[0], heads)
            value = value.index_rows(order) if isinstance(value, QuantTensor) else value.index_select(0, order)
        out[name] = value
    if unsupported:
        raise ValueError(f"{path}: GGUF formats {', '.join(sorted(unsupported))} are not served natively "
                         f"({', '.join(FORMATS)} are); use --weights dense")
    return out


def is_quantized(value: object) -> bool:
    return isinstance(value, QuantTensor)


def as_dense(value: "torch.Tensor | QuantTensor") -> torch.Tensor:
    """A state-dict entry as an fp32 tensor (a QuantTensor dequantized: the file's weights)."""
    return value.dequantize() if isinstance(value, QuantTensor) else value
