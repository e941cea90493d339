"""The last stage returns ids, not logits, for greedy requests: every logit
row's argmax in one op, and logits only for the rows sampled requests need; per item the
verifier gets argmax tokens [n] or logits [n, vocab]. Checked against a forward that returns
every logit row, on a mixed batch (greedy and sampled, trees and prefills), in one process and
over two stages."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.algo.tree import TokenTree
from cosine_ray.models.loader import build_stages
from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem, ScoreOutput
from cosine_ray.engine.worker.target import TargetWorker


def tree(tokens, parents):
    return TokenTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens))


def items(ids_only):
    """Two prefills, then (next call) two trees; ``ids_only[i]`` for request i."""
    prefills = [ScoreItem.prefill(f"r{i}", list(range(10 + i, 30 + i)), ids_only=ids_only[i]) for i in range(2)]
    trees = [ScoreItem.for_tree(f"r{i}", tree([7, 8, 9, 11], [-1, 0, 0, 1]), 20, ids_only=ids_only[i])
             for i in range(2)]
    return prefills, trees


@pytest.mark.parametrize("num_stages", [1, 2])
def test_ids_for_greedy_items_logits_for_the_rest(tiny_checkpoint, num_stages):
    state = tiny_checkpoint.load_state_dict()

    def run(ids_only):
        worker = TargetWorker(build_stages(tiny_checkpoint, state, num_stages, dtype=torch.float32,
                                                  device="cpu"))
        prefills, trees = items(ids_only)
        first = worker.score(prefills)
        worker.commit([KVCommit(f"r{i}", tuple(range(20))) for i in range(2)])
        return first + worker.score(trees), worker

    full, _ = run([False, False])
    mixed, worker = run([True, False])
    assert [t.shape for t in full] == [(1, 256), (1, 256), (4, 256), (4, 256)]
    assert [t.shape for t in mixed] == [(1,), (1, 256), (4,), (4, 256)]
    for got, want in zip(mixed, full):
        if got.ndim == 1:
            assert got.dtype == torch.int64 and torch.equal(got, want.argmax(-1))
        else:
            assert torch.equal(got, want)
    # what crosses from the last stage: argmax of every row, logits of the sampled rows only
    last = worker.stages[-1]
    hidden = None
    for stage in worker.stages:
        worker_items = [ScoreItem.for_tree(f"r{i}", tree([3], [-1]), 22, ids_only=i == 0) for i in range(2)]
        hidden = stage.forward(worker_items, hidden, [KVCommit(f"r{i}", (0, 1)) for i in range(2)])
    assert stage is last and isinstance(hidden, ScoreOutput)
    assert hidden.token_ids.shape == (2,) and hidden.logits.shape == (1, 256)


def test_greedy_requests_through_the_engine_never_ship_logits(tiny_checkpoint, monkeypatch):
    """A greedy engine's last stage returns no logit rows at all."""
    from cosine_ray.engine.worker import target as target_module
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.local import LocalEngine
    from cosine_ray.engine.request import SamplingParams

    shipped = []
    real = target_module.score_output

    def spy(score_items, logits):
        out = real(score_items, logits)
        shipped.append(out.logits.shape[0])
        return out

    monkeypatch.setattr(target_module, "score_output", spy)
    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram,self")),
                         checkpoint=tiny_checkpoint)
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=10))
    assert shipped and set(shipped) == {0}
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.8, seed=1))
    assert shipped[-1] > 0


def test_local_client_steps_other_lanes_while_the_gpu_verifies():
    """``LocalTargetClient.score`` polls the step's copy-back event and yields meanwhile (on
    CUDA the GPU verifies one lane while the host plans another); a fake event stands in for
    CUDA's: not ready twice, then ready."""
    import asyncio

    from cosine_ray.engine.worker.scoring import ScoreOutput

    from cosine_ray.engine.worker.target import PendingScore
    from cosine_ray.engine.worker.clients import LocalTargetClient

    class FakeEvent:
        def __init__(self):
            self.polls = 0

        def query(self):
            self.polls += 1
            return self.polls > 2

        def synchronize(self):
            assert self.polls > 2, "waited before the event fired"

    items = [ScoreItem("r", (5, 6), (-1, 0), 3, ids_only=True)]
    event = FakeEvent()

    class Worker:
        def score_pending(self, its):
            return PendingScore(its, ScoreOutput(torch.tensor([7, 8]), torch.empty(0, 4), event))

    order = []

    async def other_lane():
        order.append("other lane planned")

    async def main():
        client = LocalTargetClient.__new__(LocalTargetClient)
        client.worker = Worker()
        other = asyncio.ensure_future(other_lane())
        out = await client.score(items)
        order.append("scored")
        await other
        return out

    out = asyncio.run(main())
    assert order == ["other lane planned", "scored"] and event.polls == 3
    assert out[0].tolist() == [7, 8]
