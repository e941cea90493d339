"""The thread governor (``engine.worker.threads``): it keeps whichever thread count runs the
steps faster, probes the other now and then, and switching counts never changes a token."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.datasets import held_back_prompts
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.worker.threads import ThreadGovernor


class Machine:
    """Step seconds by thread count; records every count the governor sets."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.threads, self.set_calls = seconds, 2, []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.set_calls.append(n)

    def run(self, governor: ThreadGovernor, steps: int, rows: int = 1) -> list[int]:
        """The count each step ran on."""
        used = []
        for _ in range(steps):
            used.append(self.threads)
            governor.record(rows, self.seconds[self.threads])
        return used


def test_a_faster_single_thread_is_kept_after_one_probe():
    machine = Machine({2: 0.100, 1: 0.030})  # two spinning threads beside a busy core
    gov = ThreadGovernor(2, first_probe=16, probe_steps=4, set_threads=machine.set_threads)
    used = machine.run(gov, 35)
    assert used[:16] == [2] * 16 and used[16:] == [1] * 19
    assert gov.threads == 1 and gov.switches == 1 and machine.set_calls == [1, 1]


def test_the_governor_comes_back_when_all_threads_are_faster_again():
    machine = Machine({2: 0.100, 1: 0.030})
    gov = ThreadGovernor(2, first_probe=8, probe_steps=2, set_threads=machine.set_threads)
    machine.run(gov, 20)
    assert gov.threads == 1
    machine.seconds = {2: 0.012, 1: 0.020}  # the other process is gone
    used = machine.run(gov, 20)
    assert gov.threads == 2 and gov.switches == 2 and used[-1] == 2


def test_a_slower_probe_changes_nothing_and_the_next_comes_twice_as_late():
    machine = Machine({2: 0.012, 1: 0.020})
    gov = ThreadGovernor(2, first_probe=4, probe_steps=2, last_probe=16, set_threads=machine.set_threads)
    used = machine.run(gov, 4 + 2 + 8 + 2 + 16 + 2 + 16 + 2)
    probes = [i for i, n in enumerate(used) if n == 1]
    assert probes == [4, 5, 14, 15, 32, 33, 50, 51]  # after 4, 8, 16, then 16 (the cap) steps on 2
    assert gov.threads == 2 and gov.switches == 0 and machine.set_calls[-1] == 2


def test_steps_are_compared_only_with_steps_of_their_size():
    """A probe of big steps (a prefill) against small decode steps decides nothing."""
    gov = ThreadGovernor(2, first_probe=2, probe_steps=2, set_threads=lambda n: None)
    gov.record(1, 0.010)
    gov.record(1, 0.010)
    assert gov.probing
    gov.record(512, 0.001)  # no 512-row step on 2 threads to compare with
    gov.record(512, 0.001)
    assert gov.threads == 2 and not gov.probing


def test_one_thread_leaves_nothing_to_choose():
    with pytest.raises(ValueError, match="at least 2 threads"):
        ThreadGovernor(1)


@pytest.mark.real_model
@pytest.mark.parametrize("weights", ["dense", "native"])
def test_switching_threads_every_step_changes_no_token(real_checkpoint, weights):
    """A governor that probes at every other step and keeps any probe (gain 100), against none:
    the same greedy tokens, speculative and batched (the sums do not depend on the thread count)."""
    tokenizer = real_checkpoint.load_tokenizer()
    prompts = [encode_prompt(tokenizer, text) for _, text in held_back_prompts(None, 1)]
    params = SamplingParams(max_tokens=48)
    outs = {}
    previous = torch.get_num_threads()
    try:
        for name in ("fixed", "switching"):
            torch.set_num_threads(2)
            eng = LocalEngine(EngineConfig(model=str(real_checkpoint.path), drafters=parse_drafters("default"),
                                           weights=weights).replace(max_num_seqs=4), checkpoint=real_checkpoint)
            counts: list[int] = []

            def set_threads(n: int) -> None:
                counts.append(n)
                torch.set_num_threads(n)
            eng.target.governor = ThreadGovernor(2, first_probe=1, last_probe=1, probe_steps=1, gain=100.0,
                                                 set_threads=set_threads) if name == "switching" else None
            outs[name] = [o.new_token_ids for o in eng.generate(prompts, params)]
            if name == "switching":
                changes = sum(a != b for a, b in zip([2] + counts, counts))
                assert changes >= 20, counts
    finally:
        torch.set_num_threads(previous)
    assert outs["switching"] == outs["fixed"]


def test_a_step_runs_on_the_governors_count_even_after_someone_else_set_another():
    """Two engines in one process (``cosine-ray bench`` runs its systems in turn): each step is
    on its own governor's count."""
    machine = Machine({2: 0.010, 1: 0.020})
    gov = ThreadGovernor(2, first_probe=100, set_threads=machine.set_threads, get_threads=lambda: machine.threads)
    machine.threads = 1  # another engine's governor left one thread
    with gov.step(1):
        assert machine.threads == 2
    assert machine.set_calls == [2]
