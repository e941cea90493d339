"""Prompt domain classifier (algo/domains.py): synthetic checks, then the real measurement.

The ``real_model`` tests fit on the FIRST half of each packaged prompt file in
cosine_ray/data/prompts (humaneval→code, gsm8k→math, alpaca→instruction, mtbench→chat),
tokenised with SmolLM2's chat template, and measure accuracy on the SECOND half with
SmolLM2-135M's input embedding. Run with ``-s`` to see the per-domain table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cosine_ray.algo.domains import OTHER_DOMAIN, DomainClassifier, accuracy_by_domain, embed_tokens
from cosine_ray.algo.routing import normalise_embeddings
from cosine_ray.datasets import PACKAGED_PROMPT_DIR

PROMPTS_DIR = PACKAGED_PROMPT_DIR
PROMPT_FILES = {"humaneval": "code", "gsm8k": "math", "alpaca": "instruction", "mtbench": "chat"}
DATASTORE_DIR = Path(__file__).resolve().parents[2] / "cosine_ray" / "data" / "datastores" / "smollm2-135m"

# ---- synthetic: random unit embeddings, a long shared "chat template" + domain tokens -------------

TEMPLATE = list(range(10)) * 3
DOMAIN_TOKENS = {"a": range(10, 50), "b": range(50, 90), "c": range(90, 130)}


@pytest.fixture
def synthetic():
    generator = torch.Generator().manual_seed(0)
    unit = normalise_embeddings(torch.randn(200, 32, generator=generator))  # [vocab, hidden]

    def sample(domain: str, count: int, length: int = 12) -> list[list[int]]:
        tokens = list(DOMAIN_TOKENS[domain])
        picks = torch.randint(len(tokens), (count, length), generator=generator).tolist()
        return [TEMPLATE + [tokens[i] for i in row] for row in picks]

    return unit, sample


def test_synthetic_domains_are_recovered(synthetic) -> None:
    unit, sample = synthetic
    classifier = DomainClassifier.fit(unit, {d: sample(d, 30) for d in DOMAIN_TOKENS})
    accuracy = accuracy_by_domain(classifier, {d: sample(d, 200) for d in DOMAIN_TOKENS})
    assert min(accuracy.values()) >= 0.8 and sum(accuracy.values()) / 3 >= 0.9, accuracy  # chance: 1/3


def test_classify_is_the_best_similarity_and_other_below_the_floor(synthetic) -> None:
    unit, sample = synthetic
    classifier = DomainClassifier.fit(unit, {d: sample(d, 30) for d in DOMAIN_TOKENS})
    prompts = sample("a", 20) + sample("c", 20)
    best = []
    for prompt in prompts:
        sims = classifier.similarities(prompt)
        domain, cosine = classifier.classify(prompt)
        assert cosine == pytest.approx(max(sims.values())) and sims[domain] == pytest.approx(cosine)
        assert -1.0 - 1e-5 <= cosine <= 1.0 + 1e-5
        best.append(cosine)
    floor = sorted(best)[len(best) // 2]
    strict = dataclasses.replace(classifier, min_similarity=floor)
    for prompt, cosine in zip(prompts, best):
        assert (strict.classify(prompt)[0] == OTHER_DOMAIN) == (cosine < floor)


def test_fit_is_deterministic_and_single_domain_works(synthetic) -> None:
    unit, sample = synthetic
    data = {d: sample(d, 10) for d in DOMAIN_TOKENS}
    first, second = DomainClassifier.fit(unit, data), DomainClassifier.fit(unit, data)
    assert torch.equal(first.centroids, second.centroids) and torch.equal(first.whitening, second.whitening)
    only = DomainClassifier.fit(unit, {"a": data["a"]})
    assert only.classify(data["b"][0])[0] == "a"


def test_bad_input_is_rejected(synthetic) -> None:
    unit, sample = synthetic
    good = {"a": sample("a", 3)}
    with pytest.raises(ValueError, match="no domains"):
        DomainClassifier.fit(unit, {})
    with pytest.raises(ValueError, match="no non-empty"):
        DomainClassifier.fit(unit, {"a": [[]]})
    with pytest.raises(ValueError, match="reserved"):
        DomainClassifier.fit(unit, {OTHER_DOMAIN: sample("a", 3)})
    with pytest.raises(ValueError, match="shrinkage"):
        DomainClassifier.fit(unit, good, shrinkage=1.5)
    classifier = DomainClassifier.fit(unit, good)
    with pytest.raises(ValueError, match="empty"):
        classifier.classify([])
    with pytest.raises(ValueError, match="token ids must lie"):
        classifier.classify([200])
    with pytest.raises(ValueError, match="vocab, hidden"):
        embed_tokens(torch.zeros(4), [0])


# ---- the real measurement -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_split(real_checkpoint):
    """(unit embeddings, {domain: first-half token ids}, {domain: second-half token ids})."""
    from cosine_ray.engine.local import encode_prompt

    tokenizer = real_checkpoint.load_tokenizer()
    unit = normalise_embeddings(real_checkpoint.load_state_dict()["model.embed_tokens.weight"])
    fit, held_out = {}, {}
    for name, domain in PROMPT_FILES.items():
        rows = [json.loads(line) for line in (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        ids = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
        fit[domain], held_out[domain] = ids[: len(ids) // 2], ids[len(ids) // 2:]
    return unit, fit, held_out


def _report(title: str, accuracy: dict[str, float], held_out: dict[str, list]) -> tuple[float, float]:
    total = sum(len(v) for v in held_out.values())
    overall = sum(accuracy[d] * len(held_out[d]) for d in held_out) / total
    macro = sum(accuracy.values()) / len(accuracy)
    cells = "  ".join(f"{d} {accuracy[d]:.3f} (n={len(held_out[d])})" for d in held_out)
    print(f"\n{title}: {cells}  overall {overall:.3f}  domain-mean {macro:.3f}")
    return overall, macro


def _plain_centroid_accuracy(unit, fit, held_out) -> dict[str, float]:
    """Baseline: cosine to the normalised mean of the (unwhitened) prompt embeddings."""
    names = list(fit)
    centroids = torch.nn.functional.normalize(
        torch.stack([torch.stack([embed_tokens(unit, s) for s in fit[d]]).mean(0) for d in names]), dim=-1)
    return {d: sum(names[int((centroids @ embed_tokens(unit, s)).argmax())] == d for s in held_out[d])
            / len(held_out[d]) for d in names}


@pytest.mark.real_model
def test_real_prompts_second_half_accuracy(real_split) -> None:
    unit, fit, held_out = real_split
    classifier = DomainClassifier.fit(unit, fit)
    overall, macro = _report("whitened (fit: prompt files, 1st half)", accuracy_by_domain(classifier, held_out),
                             held_out)
    plain_overall, plain_macro = _report("plain centroids", _plain_centroid_accuracy(unit, fit, held_out), held_out)
    # measured: whitened 0.951 overall / 0.802 domain-mean; plain 0.811 / 0.660 (chance 0.25)
    assert overall >= 0.85 and macro >= 0.7
    assert macro >= plain_macro + 0.05 and overall >= plain_overall


@pytest.mark.real_model
def test_real_fit_from_retrieval_datastores(real_split) -> None:
    """How routing fits it: from the datastores' prompt+output sequences."""
    from cosine_ray.engine.drafters.lookup.datastore import Datastore

    unit, _, held_out = real_split
    sequences = {d: [list(s) for s in Datastore.load(DATASTORE_DIR / f"{d}.parquet").sequences] for d in held_out}
    classifier = DomainClassifier.fit(unit, sequences)
    overall, macro = _report("whitened (fit: datastores)", accuracy_by_domain(classifier, held_out), held_out)
    # measured: 0.861 overall / 0.744 domain-mean (plain centroids from the datastores: 0.252)
    assert overall >= 0.75 and macro >= 0.6
