"""What the benchmarks share (``benchmarks/``, ``cosine-ray bench`` and the tests import it):

    engines.py        the engine a benchmark measures: its config, built and warmed in one place
    workloads.py      what is sent: held-back prompts, bench's workloads, fixed-length prompts
    conversations.py  multi-turn conversations through an engine or HF, answers token by token
    reference.py      the lossless reference: HF transformers' greedy decoding
    rounds.py         interleaved rounds, and the median and min-max of what they measured
    figures.py        mean accepted length, acceptance rate, routing shares per domain
    replay.py         the drafting ceiling: drafters replayed against the target's outputs

The prompt files themselves are read by ``loadgen.prompt_sets`` (through ``cosine_ray.datasets``).
"""
