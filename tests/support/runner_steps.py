"""Mixed verify steps through two ``TargetWorker``s, one per runner mode, compared output by
output (``tests/models/test_runner.py`` on CPU, ``tests/engine/test_gpu.py`` on CUDA)."""

from __future__ import annotations

import torch

from cosine_ray.algo.tree import TokenTree
from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.models.config import stage_slices
from cosine_ray.models.llama import LlamaStage


def workers(ckpt, runner: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TargetWorker:
    state = ckpt.load_state_dict()
    stages = [LlamaStage(ckpt.config, state, a, b, device=device, dtype=dtype)
              for a, b in stage_slices(ckpt.config.num_layers, 2)]
    return TargetWorker(stages, runner=runner, kv_cache_memory=2**20 if device != "cpu" else None)


def random_tree(n: int, g: torch.Generator) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = torch.randint(0, 256, (n,), generator=g).tolist()
    return TokenTree(tuple(tokens), tuple(parents), (1.0,) * n)


def accepted_path(tree: TokenTree, g: torch.Generator) -> tuple[int, ...]:
    """Root plus a random root-to-node path (node indices in depth order)."""
    node = int(torch.randint(0, len(tree.token_ids), (1,), generator=g))
    path = []
    while node != -1:
        path.append(node)
        node = tree.parent_ids[node]
    return tuple(reversed(path))


def compare_runners(ckpt, runner: str, device: str = "cpu", *, steps: int = 14, atol: float = 3e-5,
                    tree_size: int | None = None) -> TargetWorker:
    """Mixed steps (new requests every 4th step: one prompt past the largest bucket, one
    short; random trees of 1-17 nodes for the others; random accepted paths committed; one
    request leaving every 5th step) on an eager worker and one of ``runner`` (with a verify
    bucket of ``tree_size`` rows if given): the same ids, logits within ``atol`` (on CPU the eager
    forward attends through ``kernels.attend_rows`` and the padded one through PyTorch's SDPA: two
    fp32 summation orders, 1.2e-5 apart at most on these steps). Returns the
    ``runner`` worker (its stats say which path ran)."""
    eager, other = workers(ckpt, "eager", device), workers(ckpt, runner, device)
    if tree_size is not None:  # a verify bucket of exactly that many rows, as an engine adds
        for stage in other.stages:
            stage.runner.tree_size(tree_size)
    g = torch.Generator().manual_seed(3)
    lengths: dict[str, int] = {}
    for step in range(steps):
        items = []
        if step % 4 == 0:
            for rid, n in ((f"long{step}", 40 + step), (f"short{step}", 3 + step % 5)):
                items.append(ScoreItem.prefill(rid, torch.randint(0, 256, (n,), generator=g).tolist()))
        trees = {}
        for rid, length in sorted(lengths.items()):
            tree = random_tree(int(torch.randint(1, 18, (1,), generator=g)), g)
            trees[rid] = tree
            items.append(ScoreItem.for_tree(rid, tree, length, ids_only=bool(step % 2)))
        outs = [w.score(items) for w in (eager, other)]
        for it, a, b in zip(items, *outs):
            if it.ids_only:
                assert torch.equal(a.cpu(), b.cpu()), (step, it.request_id)
            else:
                torch.testing.assert_close(b, a, atol=atol, rtol=atol)
        commits = []
        for it in items:
            if it.parent_ids is None:  # a prefill: keep the chain
                commits.append(KVCommit(it.request_id, tuple(range(len(it.token_ids)))))
                lengths[it.request_id] = len(it.token_ids)
            else:
                keep = accepted_path(trees[it.request_id], g)
                commits.append(KVCommit(it.request_id, keep))
                lengths[it.request_id] += len(keep)
        for w in (eager, other):
            w.commit(commits)
        if step % 5 == 4:
            gone = sorted(lengths)[0]
            del lengths[gone]
            for w in (eager, other):
                w.release([gone])
    return other
