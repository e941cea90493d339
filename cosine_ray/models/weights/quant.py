"""GGUF weights kept quantized: the block formats, reading a GGUF file, and embedding lookups.

Terms. A GGUF *block* holds 32 consecutive weights of one row (along the input dimension K):
``Q4_0`` / ``Q5_0`` (fp16 scale d, 4- / 5-bit codes q: w = d (q - 8 | 16)), ``Q4_1`` / ``Q5_1``
(fp16 d and min m: w = d q + m), ``Q8_0`` (fp16 d, int8 codes: w = d q). The *K formats* hold
256 weights, a superblock of eight groups of 32: ``Q4_K`` / ``Q5_K`` (fp16 d and dmin, 6-bit
scale sc and min mn a group: w = d sc q - dmin mn), ``Q6_K`` (fp16 d, an int8 scale a 16 and
6-bit codes: w = d sc (q - 32)); llama.cpp's ``_M`` files mix them with its fallbacks (Q5_0,
Q5_1, Q8_0) for rows whose length is not a multiple of 256. A :class:`QuantTensor` is a matrix
[N, K] of such blocks, rows in the order of our checkpoint names (``gguf_weights`` reads a file).

Its projections are ``models.linear.QuantLinear``. For PyTorch's int4 weight-only kernels (groups
of 32, affine per group, ``w = (u - 8) s + z`` with u in 0..15) ``int4_affine`` gives the same
weights (``INT4_FORMATS``): Q4_0, Q4_1 and Q4_K map one to one (s = d, z = m + 8 d for Q4_1; s =
d sc, z = 8 s - dmin mn for Q4_K); a Q8_0 code q = 16 h + l splits into two 4-bit codes, so its
matrix becomes [N, 2K] with groups (16 d, 0) over h + 8 and (d, 8 d) over l, and the input is fed
twice: the products are exactly the file's weights (powers of two scale exactly). The 5- and
6-bit formats have no such form. :class:`QuantEmbedding` dequantizes the rows it looks up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
"""Weights per GGUF block (a group), and the group size of the int4 kernels."""
SUPERBLOCK = 256
"""Weights per block of the K formats."""
FORMATS = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
"""Supported block formats and their bytes per block (of 32 weights; the K formats' of 256)."""
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")
INT4_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")
"""Formats PyTorch's int4 kernels multiply exactly (``int4_affine``)."""


def block_weights(fmt: str) -> int:
    """Weights a block of ``fmt`` holds."""
    return SUPERBLOCK if fmt in K_FORMATS else GROUP


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A matrix [rows, cols] stored as GGUF blocks."""

    fmt: str
    """A key of ``FORMATS``."""
    blocks: torch.Tensor
    """[rows, cols / 32 * bytes per block] uint8, the file's bytes."""
    cols: int

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"GGUF format {self.fmt} is not served natively (use {', '.join(FORMATS)})")
        width = block_weights(self.fmt)
        if self.cols % width or self.blocks.shape[1] != self.cols // width * FORMATS[self.fmt]:
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

    def _fields(self) -> tuple:
        """The blocks' fields, as ``kernels.pack_quant`` takes them: (d, m or None, codes), d and m
        [rows, groups] fp32 (fp16 values), codes [rows, cols] uint8 (0..15, Q5: 0..31; Q8_0:
        int8); the K formats (d, dmin or None, codes, sub): d and dmin [rows, cols / 256], codes
        (0..15, 0..31, 0..63) and sub [rows, groups, 2] uint8, each group's sc and mn (Q6_K: its
        two int8 scales, as bytes)."""
        rows, width = self.blocks.shape[0], block_weights(self.fmt)
        b = self.blocks.view(rows, self.cols // width, FORMATS[self.fmt])

        def half(at: int) -> torch.Tensor:
            return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()

        def nibbles(qs: torch.Tensor) -> torch.Tensor:
            """[..., n] bytes -> [..., 2, n]: the low nibbles, then the high ones"""
            return torch.stack([qs & 15, qs >> 4], dim=-2)

        if self.fmt == "Q8_0":
            return half(0), None, b[..., 2:].contiguous().view(torch.int8).reshape(rows, self.cols)
        if self.fmt in ("Q4_0", "Q4_1"):  # element j in the low nibble, j + 16 in the high one
            first = 4 if self.fmt == "Q4_1" else 2
            return half(0), half(2) if self.fmt == "Q4_1" else None, nibbles(b[..., first:]).reshape(rows, self.cols)
        if self.fmt in ("Q5_0", "Q5_1"):  # then bit j of the 32-bit qh: element j's fifth bit
            first = 4 if self.fmt == "Q5_1" else 2
            qh = b[..., first:first + 4].long()
            qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
            high = (qh[..., None] >> torch.arange(32)) & 1
            codes = nibbles(b[..., first + 4:]).flatten(-2) | (high << 4).to(torch.uint8)
            return half(0), half(2) if self.fmt == "Q5_1" else None, codes.reshape(rows, self.cols)
        if self.fmt == "Q6_K":  # ql [2][64] (low, high nibbles), qh [2][32] (4 x 2 bits), 16 int8 scales, d
            low = nibbles(b[..., :128].reshape(rows, -1, 2, 64))  # [rows, sb, 2, 2, 64]
            high = (b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
            codes = low.reshape(rows, -1, SUPERBLOCK) | (high.reshape(rows, -1, SUPERBLOCK) << 4)
            return half(208), None, codes.reshape(rows, self.cols), b[..., 192:208].reshape(rows, -1, 2).contiguous()
        scales = b[..., 4:16].reshape(rows, -1, 3, 4)  # Q4_K, Q5_K: 8 six-bit scales and mins in 12 bytes
        sd, sm, both = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
        sc = torch.cat([sd & 63, (both & 15) | ((sd >> 2) & 48)], dim=-1)
        mn = torch.cat([sm & 63, (both >> 4) | ((sm >> 2) & 48)], dim=-1)
        sub = torch.stack([sc, mn], dim=-1).reshape(rows, -1, 2)
        if self.fmt == "Q4_K":  # qs [4][32]: low nibbles, elements 64 j + l; high ones, 64 j + 32 + l
            return half(0), half(2), nibbles(b[..., 16:].reshape(rows, -1, 4, 32)).reshape(rows, self.cols), sub
        high = (b[..., 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        codes = nibbles(b[..., 48:].reshape(rows, -1, 4, 32)).reshape(rows, -1, SUPERBLOCK) | (high.reshape(rows, -1, SUPERBLOCK) << 4)
        return half(0), half(2), codes.reshape(rows, self.cols), sub

    def _group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(scale, offset, codes): w = scale q + offset over groups of 32 (Q6_K: of 16), with
        scale and offset [rows, groups] fp32 as the GGUF reference computes them (d sc, - dmin mn)
        and q the codes less any shift (Q4_0 8, Q5_0 16, Q6_K 32)."""
        fields = self._fields()
        d, m, codes = fields[:3]
        rows = codes.shape[0]
        if self.fmt in ("Q8_0", "Q4_1", "Q5_1"):
            return d, m, codes.float()
        if self.fmt in ("Q4_0", "Q5_0"):
            return d, None, codes.float() - (8 if self.fmt == "Q4_0" else 16)
        sub = fields[3]
        if self.fmt == "Q6_K":
            scale = d.repeat_interleave(16, dim=1) * sub.view(torch.int8).reshape(rows, -1).float()
            return scale, None, codes.float() - 32
        scale = d.repeat_interleave(8, dim=1) * sub[..., 0].float()
        return scale, -(m.repeat_interleave(8, dim=1) * sub[..., 1].float()), codes.float()

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed as the GGUF reference does (d q + m, d (q - 8), d sc q -
        dmin mn, ...)."""
        scale, offset, q = self._group_scales()
        rows, groups = scale.shape
        w = scale[..., None] * q.view(rows, groups, -1)
        if offset is not None:
            w = w + offset[..., None]
        return w.view(rows, self.cols)

    def int4_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, s, z): u  # [rows, K'] int32 codes 0..15; s, z  # [rows, K' / 32] fp32, with
        ``(u - 8) s + z`` the weights (K' = cols, or 2 cols for Q8_0: high codes, then low).
        ValueError for the formats outside ``INT4_FORMATS``."""
        if self.fmt not in INT4_FORMATS:
            raise ValueError(f"GGUF format {self.fmt} has no int4 form (its codes are wider than 4 bits)")
        if self.fmt == "Q4_K":
            scale, offset, q = self._group_scales()
            return q.int(), scale, offset + 8 * scale
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
