"""Verify-forward time of the target: our stage against HF eager, a minimal static step and the
bandwidth roofline, on any device (``--shapes``); or the real SmolLM2-135M split in 2 stages
per CPU projection kernel (``--kernels``, the default mode).

    python benchmarks/kernels/verify_forward.py --shapes smollm2-135m,llama-3.2-1b [--device cuda] [--dtype bfloat16]
    python benchmarks/kernels/verify_forward.py [--threads 1] [--context 128] [--reps 8] [--kernels blocked,onednn,mkl]

``--shapes`` builds a random-weight model of each named shape (``SHAPES``), prefills
``--context`` tokens for each of b requests and times one verify forward of n new tokens per
request, median of ``--reps``, in four columns: ours eager and ours with the step runner (a
CUDA graph on CUDA; the same fixed-shape step run eagerly on CPU), HF eager, a minimal static
step in plain PyTorch, and the roofline (``--bandwidth-gbs``). Kernels mode times both stages
with each named CPU projection kernel (``COSINE_RAY_CPU_GEMM``: our ``blocked`` one, oneDNN's,
MKL's) alternating rep by rep (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cosine_ray.engine.profile import median_seconds
from cosine_ray.models import kernels
from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.loader import resolve_checkpoint


SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
    "tiny": (64, 2, 4, 2, 128, 256, False),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, True),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, False),
}
BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0}
"""HBM bandwidth by GPU name (SXM datasheets), for the roofline column."""


def hf_config(name: str):
    from transformers import LlamaConfig
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[name]
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                       tie_word_embeddings=tied, max_position_embeddings=8192, rms_norm_eps=1e-5)


def _median_ms(run, reps: int, device: torch.device) -> float:
    """One warm-up call (for the static step on CUDA: after its capture), then the median."""
    return median_seconds(run, 1, reps, str(device)) * 1e3


class StaticStep:
    """A minimal fixed-shape verify step over ``stage``'s weights: b requests × n new tokens on
    a static KV of ``context + n`` slots per request and layer, one SDPA call per layer; on CUDA
    the whole step is captured in a CUDA graph and replayed."""

    def __init__(self, stage: LlamaStage, b: int, n: int, context: int) -> None:
        from cosine_ray.models.llama import _rms_norm, _rotate_half
        self.stage, self.norm, self.rotate = stage, _rms_norm, _rotate_half
        cfg, dev, dt = stage.config, stage.device, stage.dtype
        self.b, self.n, self.context = b, n, context
        shape = (b, cfg.num_kv_heads, context + n, cfg.head_dim)
        self.k = [torch.randn(shape, device=dev, dtype=dt) for _ in stage.layers]
        self.v = [torch.randn(shape, device=dev, dtype=dt) for _ in stage.layers]
        self.ids = torch.randint(0, cfg.vocab_size, (b * n,), device=dev)
        positions = torch.arange(context, context + n, device=dev).repeat(b)
        freqs = positions[:, None].float() * stage.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dt)[:, None], emb.sin().to(dt)[:, None]
        mask = torch.ones(n, context + n, dtype=torch.bool, device=dev)
        mask[:, context:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
        self.mask = mask
        self.graph = None
        if dev.type == "cuda":
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.out = self.step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step()

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        st, cfg = self.stage, self.stage.config
        nh, nkv, hd, b, n, c = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.b, self.n, self.context
        x = torch.nn.functional.embedding(self.ids, st.embed_weight)
        for i, layer in enumerate(st.layers):
            h = self.norm(x, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = layer.qkv(h).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(-1, nh, hd) * self.cos + self.rotate(q.view(-1, nh, hd)) * self.sin
            k = k.view(-1, nkv, hd) * self.cos + self.rotate(k.view(-1, nkv, hd)) * self.sin
            self.k[i][:, :, c:] = k.view(b, n, nkv, hd).transpose(1, 2)
            self.v[i][:, :, c:] = v.view(b, n, nkv, hd).transpose(1, 2)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.view(b, n, nh, hd).transpose(1, 2), self.k[i], self.v[i], attn_mask=self.mask,
                scale=st.attention_scale, enable_gqa=nkv != nh)
            x = x + layer.o(o.transpose(1, 2).reshape(b * n, nh * hd))
            h = self.norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(torch.nn.functional.silu(gate) * up)
        return st.lm_head(self.norm(x, st.norm_weight, cfg.rms_norm_eps)).argmax(-1)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


def run_shapes(args) -> None:
    import warnings

    from transformers import DynamicCache, LlamaForCausalLM
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # still accepted

    from cosine_ray.algo.tree import TokenTree
    from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
    from cosine_ray.engine.worker.target import StageWorker
    from cosine_ray.models.config import ModelConfig
    from cosine_ray.models.device import require_device

    require_device(args.device)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth = args.bandwidth_gbs
    if bandwidth is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        bandwidth = next((bw for key, bw in BANDWIDTH_GBS.items() if key in name), None)
    batches = [int(b) for b in args.batches.split(",")]
    tokens = [int(n) for n in args.tokens.split(",")]
    print(f"device {args.device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.dtype}, context {args.context}, median of {args.reps} (ms per verify forward; "
          f"roofline at {bandwidth or '?'} GB/s)")
    fixed = "graph" if device.type == "cuda" else "static"
    print(f"| shape | requests × new tokens | ours eager | ours {fixed} | HF eager | static step"
          + (" (CUDA graph)" if device.type == "cuda" else "")
          + f" | roofline | ours {fixed} ÷ static step | ours {fixed} ÷ HF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes.split(","):
        torch.manual_seed(0)
        config = hf_config(name)
        with torch.device(device):  # random init on the device: seconds, not minutes, for 8B
            hf = LlamaForCausalLM(config)
        hf = hf.to(dtype=dtype).eval()
        mcfg = ModelConfig.from_hf(config)
        stage = LlamaStage(mcfg, hf.state_dict(), dtype=dtype, device=device)
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        kv_per_token = mcfg.num_layers * 2 * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
        for b in batches:
            workers = {mode: StageWorker(stage, runner=mode) for mode in ("eager", fixed)}
            rids = [f"r{i}" for i in range(b)]
            prompt = torch.randint(0, mcfg.vocab_size, (args.context,)).tolist()
            for worker in workers.values():
                worker.forward([ScoreItem.prefill(r, prompt, ids_only=True) for r in rids])
                worker.commit([KVCommit(r, tuple(range(args.context))) for r in rids])
            cache = DynamicCache()
            with torch.inference_mode():
                hf(torch.tensor([prompt] * b, device=device), past_key_values=cache, use_cache=True)
            for n in tokens:
                chain = TokenTree(tuple(prompt[:n]), tuple(range(-1, n - 1)), (1.0,) * n)
                items = [ScoreItem.for_tree(r, chain, args.context, ids_only=True) for r in rids]
                new_ids = torch.tensor([prompt[:n]] * b, device=device)

                def ours(worker):
                    def run():
                        worker.forward(items)
                        worker.commit([KVCommit(r, ()) for r in rids])
                    return run

                def hf_eager():
                    with torch.inference_mode():
                        hf(new_ids, past_key_values=cache, use_cache=True)
                    cache.crop(-n)  # back to the context

                static = StaticStep(stage, b, n, args.context)
                ms = {k: _median_ms(f, args.reps, device) for k, f in (
                    ("eager", ours(workers["eager"])), ("fixed", ours(workers[fixed])), ("hf", hf_eager),
                    ("static", static))}
                roof = ((weight_bytes + b * (args.context + n) * kv_per_token) / (bandwidth * 1e9) * 1e3
                        if bandwidth else None)
                print(f"| {name} | {b} × {n} | {ms['eager']:.2f} | {ms['fixed']:.2f} | {ms['hf']:.2f} | "
                      f"{ms['static']:.2f} | {'' if roof is None else f'{roof:.2f}'} | "
                      f"{ms['fixed'] / ms['static']:.2f}× | {ms['fixed'] / ms['hf']:.2f}× |", flush=True)
                del static
            for worker in workers.values():
                worker.release(rids)
            del workers
        del hf, stage
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--kernels", default="blocked,onednn")
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)}: the shapes mode")
    ap.add_argument("--batches", default="1,8,32", help="shapes mode: requests per forward")
    ap.add_argument("--tokens", default="1,8", help="shapes mode: new tokens per request")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the roofline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(SHAPES)
        if unknown:
            ap.error(f"unknown shape(s) {', '.join(sorted(unknown))}; known: {', '.join(SHAPES)}")
        run_shapes(args)
        return
    checkpoint = resolve_checkpoint("smollm2-135m")
    state = checkpoint.load_state_dict()
    half = checkpoint.config.num_layers // 2
    kernel_names = [k.strip() for k in args.kernels.split(",")]
    models = {}
    for kernel in kernel_names:
        os.environ[kernels.ENV] = kernel
        stages = [LlamaStage(checkpoint.config, state, 0, half), LlamaStage(checkpoint.config, state, half)]
        models[kernel] = (stages, [s.new_kv_cache() for s in stages])

    def one(kernel: str, num_requests: int, n: int) -> float:
        stages, caches = models[kernel]
        rids = [f"r{i}" for i in range(num_requests)]
        for cache in caches:
            for rid in rids:
                if rid not in cache.request_ids:
                    cache.allocate(rid)
                cache.truncate(rid, 0)

        def forward(batch: StageBatch) -> None:
            stages[1].forward(batch, caches[1], stages[0].forward(batch, caches[0]))

        forward(StageBatch.from_chains(rids, [[5] * args.context for _ in rids], [0] * num_requests))
        for cache in caches:
            for rid in rids:
                cache.commit(rid)
        batch = StageBatch.from_chains(rids, [[7] * n for _ in rids], [args.context] * num_requests,
                                       last_logits_only=False)
        start = time.perf_counter()
        forward(batch)
        return time.perf_counter() - start

    def measure(num_requests: int, n: int) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in kernel_names}
        for rep in range(args.reps + 2):
            for kernel in kernel_names:
                t = one(kernel, num_requests, n)
                if rep >= 2:  # two warm-up rounds
                    times[kernel].append(t)
        return {k: statistics.median(v) * 1e3 for k, v in times.items()}

    print(f"threads={args.threads}, context {args.context}, median of {args.reps}, kernels alternating "
          f"(ms per verify forward; ratio = {kernel_names[0]} / {kernel_names[-1]})")
    print("| requests × new tokens | " + " | ".join(kernel_names) + " | ratio |")
    print("| --- |" + " --- |" * (len(kernel_names) + 1))
    for num_requests in (1, 4, 8):
        for n in (1, 2, 5, 9, 17):
            ms = measure(num_requests, n)
            print(f"| {num_requests} × {n} | " + " | ".join(f"{ms[k]:.1f}" for k in kernel_names)
                  + f" | {ms[kernel_names[0]] / ms[kernel_names[-1]]:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
