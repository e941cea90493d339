"""A c = 1 plain decode step against the memory-bandwidth limit of this machine.

    python benchmarks/kernels/forward_limit.py [--model smollm2-135m] [--threads 2] [--context 256]
        [--steps 40] [--rounds 3] [--paths dense,dense-unfused,native,native-unfused,dense-onednn,native-int4pack,dense-bf16] [--divergence 12]

At one request a decode step reads every projection's weights once, so its floor is
*bytes of weights read per token ÷ memory bandwidth*. This command measures the bandwidth (a sum
over a 512 MiB buffer with ``--threads`` threads, best of several), counts the bytes each weights
path reads per token (dense fp32 / bf16 matrices, or native GGUF codes + group scales), and times,
interleaved round by round, for each path: the whole step (``LlamaStage.forward``, one token after
a ``--context``-token prompt) and the step's projections alone (every matrix of the step applied
to one row in turn: the kernels' floor). It prints the limit beside both, then one torch.profiler
split of each path's step (projections / attention / the rest). ``--divergence N`` also decodes the
first N held-back prompts greedily on each path and counts texts identical to transformers' fp32
greedy; at each first divergence it prints the logit gap of transformers' fp32 logits there.

Paths: ``dense`` and ``native`` (the fp32 checkpoint, the GGUF blocks: our kernels where they
build), ``dense-onednn`` and ``native-int4pack`` (oneDNN's packed linear, PyTorch's int4 kernel
with bf16 activations), ``*-unfused`` (``COSINE_RAY_FUSED_LAYERS=0``), ``dense-bf16`` (oneDNN).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from cosine_ray.bench.reference import hf_greedy_with_logits
from cosine_ray.bench.rounds import Spread
from cosine_ray.models import kernels
from cosine_ray.models.linear import DenseLinear, QuantLinear
from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.models.weights.native import load_weights

PATHS = {"dense": ("dense", torch.float32, {}), "dense-onednn": ("dense", torch.float32, {kernels.ENV: "onednn"}),
         "dense-unfused": ("dense", torch.float32, {kernels.FUSED_ENV: "0"}),
         "native": ("native", torch.float32, {}), "native-int4pack": ("native", torch.float32, {kernels.ENV: "onednn"}),
         "native-unfused": ("native", torch.float32, {kernels.FUSED_ENV: "0"}),
         "dense-bf16": ("dense", torch.bfloat16, {})}
"""name -> (weights mode, dtype, environment while the stage is built)"""


def bandwidth_gbs(threads: int, mib: int = 512, reps: int = 7) -> float:
    """Best read bandwidth of a ``mib`` MiB fp32 buffer, summed with ``threads`` threads."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib << 18)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(reps))
    return buf.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def projections(stage: LlamaStage) -> list:
    out = [p for layer in stage.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return out + ([stage.lm_head] if stage.lm_head is not None else [])


def weight_bytes(proj) -> int:
    """Bytes one application of ``proj`` reads from its weights."""
    if isinstance(proj, QuantLinear):
        return proj.nbytes
    if proj.blocked is not None:
        return proj.out_features * proj.blocked.shape[1] * 4  # the padding is never read for real rows
    w = proj.packed if proj.packed is not None else proj.w_t
    return w.numel() * w.element_size()


class Decoder:
    """One request decoding one token a step after a ``context``-token prompt."""

    def __init__(self, stage: LlamaStage, context: int) -> None:
        self.stage, self.context = stage, context
        self.kv = stage.new_kv_cache()
        self.reset()

    def reset(self) -> None:
        if "r" in self.kv:
            self.kv.free("r")
        self.kv.allocate("r")
        prompt = [(17 * i) % 1000 + 10 for i in range(self.context)]
        out = self.stage.forward(StageBatch.from_chains(["r"], [prompt], [0]), self.kv)
        self.kv.commit("r")
        self.token = int(out.argmax())

    def step(self) -> None:
        batch = StageBatch.from_chains(["r"], [[self.token]], [self.kv.committed_length("r")])
        self.token = int(self.stage.forward(batch, self.kv).argmax())
        self.kv.commit("r")


def time_steps(dec: Decoder, steps: int) -> list[float]:
    dec.reset()
    dec.step()
    return [_timed(dec.step) for _ in range(steps)]


def time_projections(stage: LlamaStage, steps: int) -> list[float]:
    dtype = stage.dtype
    rows = [torch.randn(1, p.in_features if isinstance(p, QuantLinear) else _in_features(p), dtype=dtype)
            for p in projections(stage)]
    pairs = list(zip(projections(stage), rows))

    def run():
        with torch.inference_mode():
            for p, x in pairs:
                p(x)
    run()
    return [_timed(run) for _ in range(steps)]


def _in_features(p: DenseLinear) -> int:
    if p.blocked is not None:
        return int(p.blocked.shape[1])
    if p.w_t is not None:
        return int(p.w_t.shape[0])
    return int(p.packed.shape[1])  # oneDNN's packed weight keeps [out, in]


@contextlib.contextmanager
def _projections_labelled():
    """``models.kernels`` run through ctypes, which the profiler cannot see: while profiling,
    every projection on it is recorded as ``kernels.linear`` (counted as a projection), and a
    fused stage's layers, one call a step (``kernels.FusedStack``: their projections, small
    operations and attention together), as ``kernels.stage_layers``."""
    calls = {cls: cls.__call__ for cls in (DenseLinear, QuantLinear)}
    stack = kernels.FusedStack.__call__

    def labelled_stack(self, *args):
        with torch.profiler.record_function("kernels.stage_layers"):
            return stack(self, *args)

    def labelled(call):
        def run(self, x):
            if self.blocked is None:
                return call(self, x)
            with torch.profiler.record_function("kernels.linear"):
                return call(self, x)
        return run
    for cls, call in calls.items():
        cls.__call__ = labelled(call)
    kernels.FusedStack.__call__ = labelled_stack
    try:
        yield
    finally:
        for cls, call in calls.items():
            cls.__call__ = call
        kernels.FusedStack.__call__ = stack


def split(stage: LlamaStage, dec: Decoder, steps: int) -> dict[str, float]:
    """ms per step in projections / attention / everything else (torch.profiler, self time)."""
    dec.reset()
    with _projections_labelled(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            dec.step()
        wall = time.perf_counter() - start
    parts = {"projections": 0.0, "a stage's layers in one call (projections, small ops, attention)": 0.0,
             "attention": 0.0}
    for e in prof.key_averages():
        name = e.key
        if name == "kernels.stage_layers":
            parts["a stage's layers in one call (projections, small ops, attention)"] += e.self_cpu_time_total
        elif "linear" in name or "int4pack" in name or name in ("aten::mm", "aten::addmm"):
            parts["projections"] += e.self_cpu_time_total
        elif "attention" in name:
            parts["attention"] += e.self_cpu_time_total
    out = {k: v / 1e3 / steps for k, v in parts.items()}
    out["rest (host + small ops)"] = wall * 1e3 / steps - sum(out.values())
    out["step under the profiler"] = wall * 1e3 / steps
    return out


def divergence(paths: dict[str, LlamaStage], ckpt, n: int, max_tokens: int) -> None:
    from cosine_ray.datasets import held_back_prompts
    from cosine_ray.engine.local import encode_prompt

    tokenizer = ckpt.load_tokenizer()
    hf = ckpt.load_hf_model()
    prompts = [encode_prompt(tokenizer, t) for _, t in held_back_prompts(None, None)][:n]
    print(f"\ngreedy, {max_tokens} tokens, first {len(prompts)} held-back prompts, against transformers fp32:")
    refs = [hf_greedy_with_logits(hf, ids, max_tokens) for ids in prompts]
    for name, stage in paths.items():
        same, gaps = 0, []
        for k, (ids, (ref, logits)) in enumerate(zip(prompts, refs)):
            ours = greedy(stage, ids, len(ref))
            if ours == ref:
                same += 1
                continue
            i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
            gaps.append(f"prompt {k} at {i}: HF gap {float(logits[i][ref[i]] - logits[i][ours[i]]):.4f}")
        print(f"  {name}: {same}/{len(prompts)} identical" + ("; " + "; ".join(gaps) if gaps else ""))


def greedy(stage: LlamaStage, ids: list[int], n: int) -> list[int]:
    kv = stage.new_kv_cache()
    kv.allocate("g")
    out, tokens = stage.forward(StageBatch.from_chains(["g"], [ids], [0]), kv), []
    kv.commit("g")
    while len(tokens) < n:
        tokens.append(int(out.argmax()))
        out = stage.forward(StageBatch.from_chains(["g"], [[tokens[-1]]], [kv.committed_length("g")]), kv)
        kv.commit("g")
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="dense,native,dense-bf16")
    ap.add_argument("--divergence", type=int, default=0, help="held-back prompts to compare with HF fp32 greedy")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in names if p not in PATHS]
    if bad or min(args.threads, args.context, args.steps, args.rounds) < 1:
        print(f"forward_limit: use --paths from {', '.join(PATHS)} and positive counts", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    ckpt = resolve_checkpoint(args.model)
    bw = bandwidth_gbs(args.threads)
    print(f"memory bandwidth, {args.threads} threads (sum of 512 MiB, best of 7): {bw:.1f} GB/s")
    stages, decoders = {}, {}
    for name in names:
        mode, dtype, env = PATHS[name]
        if name == "dense-bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print("dense-bf16: skipped (this CPU has no native bf16 GEMM)")
            continue
        try:
            with mock.patch.dict(os.environ, env):
                stages[name] = LlamaStage(ckpt.config, load_weights(ckpt, mode), dtype=dtype)
        except ValueError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        decoders[name] = Decoder(stages[name], args.context)
    steps = {n: [] for n in stages}
    bare = {n: [] for n in stages}
    for _ in range(args.rounds):  # interleaved: every path once per round
        for name, stage in stages.items():
            steps[name] += time_steps(decoders[name], args.steps)
            bare[name] += time_projections(stage, args.steps)
    print(f"\nc = 1 plain decode step after {args.context} tokens, {args.rounds} interleaved rounds x {args.steps} steps "
          f"(median, min-max of round medians):")
    print(f"{'path':<12} {'weights MB/token':>16} {'limit ms':>9} {'projections ms':>15} {'step ms':>22} {'tok/s':>7}")
    for name, stage in stages.items():
        mb = sum(weight_bytes(p) for p in projections(stage)) / 1e6
        limit = mb / 1e3 / bw * 1e3
        rounds = Spread.of([statistics.median(steps[name][r * args.steps:(r + 1) * args.steps]) * 1e3
                            for r in range(args.rounds)])
        med = statistics.median(steps[name]) * 1e3
        print(f"{name:<12} {mb:>16.1f} {limit:>9.1f} {statistics.median(bare[name]) * 1e3:>15.1f} "
              f"{med:>8.1f} ({rounds.low:.1f}-{rounds.high:.1f}) {1e3 / med:>7.1f}")
    for name, stage in stages.items():
        parts = split(stage, decoders[name], args.steps)
        print(f"\n{name}: where a step goes (torch.profiler, ms per step)")
        for k, v in parts.items():
            print(f"  {k:<26} {v:8.2f}")
    if args.divergence:
        divergence(stages, ckpt, args.divergence, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
