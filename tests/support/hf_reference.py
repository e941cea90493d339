"""The reference every lossless test compares with: Hugging Face ``generate`` greedy, fp32
(``cosine_ray.bench.reference``, the one the benchmarks and ``cosine-ray bench`` use)."""

from cosine_ray.bench.reference import hf_greedy

__all__ = ["hf_greedy"]
