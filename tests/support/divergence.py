"""Where a speculative output leaves a plain one, and by how much the target's logits separated
the two tokens there: what the bf16 and native-weight lossless tests judge (a divergence is
allowed only at a near-tie of the two logits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosine_ray.engine.worker.scoring import ScoreItem


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int | None
    """None: one output is a prefix of the other (a real difference, never a tie)."""
    plain: int | None = None
    speculative: int | None = None
    gap: float = 0.0
    """The target's logit of the plain token less that of the speculative one, at ``position``."""

    def __str__(self) -> str:
        return (f"prompt {self.prompt}: position {self.position}, plain {self.plain}, "
                f"speculative {self.speculative}, logit gap {self.gap:+.4f}")


def divergences(worker, prompts: Sequence[list[int]], plain: Sequence[list[int]],
                speculative: Sequence[list[int]]) -> tuple[int, list[Divergence]]:
    """(outputs identical to the plain ones, a ``Divergence`` for each other output), the gaps
    scored by ``worker`` (a ``TargetWorker`` on the same precision path as ``plain``)."""
    identical, found = 0, []
    for k, (prompt, ref, ours) in enumerate(zip(prompts, plain, speculative)):
        if ours == ref:
            identical += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if i is None:
            found.append(Divergence(k, None))
            continue
        logits = worker.score([ScoreItem.prefill(f"gap-{k}", list(prompt) + list(ref[:i]))])[0][-1].float()
        worker.release([f"gap-{k}"])
        found.append(Divergence(k, i, ref[i], ours[i], float(logits[ref[i]] - logits[ours[i]])))
    return identical, found
