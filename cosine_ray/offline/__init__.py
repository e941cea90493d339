"""The offline API (vLLM's ``LLM``/``SamplingParams``): ``from cosine_ray import LLM, SamplingParams``."""

from cosine_ray.offline.llm import LLM
from cosine_ray.offline.outputs import CompletionOutput, Logprob, RequestOutput
from cosine_ray.offline.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
