"""Our CPU kernels, in C, one op family a file, each with its Python wrapper:

- ``gemm``: fp32 projections over weights packed in 32-column blocks (``pack``, ``linear``);
- ``qgemm``: GGUF Q4_0 / Q4_1 / Q8_0 projections kept quantized (``pack_quant``, ``linear_quant``);
- ``layer``: a decoder layer's norms, RoPE, residual adds and SiLU · up around its projections
  (``FusedLayer``);
- ``attention``: the attention of a step's query rows over the KV pool (``attend_rows``);
- ``stage``: a stage's fused layers and their attention in one call a step (``FusedStack``).

Every family keeps one invariant: a row's result is summed in one fixed order, so it never
depends on the other rows of the call, the tile, the thread count or the vector width (what keeps
batched and speculative decoding equal to plain decoding). ``simd.h`` holds the vector types and
the AVX-512 / AVX2 / plain-C choice, ``kernels.h`` the entry points and the structures that cross
files. ``build`` compiles all the ``.c`` files in one compiler call into one shared library
(each family its own translation unit), caches it and loads it; ``COSINE_RAY_CPU_GEMM`` and
``COSINE_RAY_FUSED_LAYERS`` say where it is used.
"""

from cosine_ray.models.kernels.attention import TILE_VECTORS, attend_rows
from cosine_ray.models.kernels.build import ENV, FUSED_ENV, KERNELS, available, choice, fused_on, source_digest, used_on
from cosine_ray.models.kernels.gemm import BLOCK, linear, pack, pad_bias, unpack
from cosine_ray.models.kernels.layer import MAX_HEAD_DIM, FusedLayer, LayerScratch
from cosine_ray.models.kernels.qgemm import QUANT_KINDS, BlockedQuant, linear_quant, pack_quant, quant_scratch, round_rows
from cosine_ray.models.kernels.stage import FusedStack

__all__ = ["BLOCK", "ENV", "FUSED_ENV", "KERNELS", "MAX_HEAD_DIM", "QUANT_KINDS", "TILE_VECTORS", "BlockedQuant", "FusedLayer",
           "FusedStack", "LayerScratch", "attend_rows", "available", "choice", "fused_on", "linear", "linear_quant",
           "pack", "pack_quant", "pad_bias", "quant_scratch", "round_rows", "source_digest", "unpack", "used_on"]
