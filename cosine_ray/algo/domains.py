"""Prompt domain classifier: which domain (code, math, ...) a request's prompt belongs to.

Requests arrive without a label, and expertise routing (``algo.routing``) starts a request
from its domain's prior. The feature is the target's own input embedding ``H`` (the table
eq. 1 uses), no extra model::

    e(prompt)  = normalise(mean_t H(token_t))                     # [hidden], H rows unit-length
    z(prompt)  = W · (e(prompt) − μ)                              # whitened, centred
    centroid_d = normalise(mean_{s ∈ domain d} z(s))
    classify   = argmax_d cos(z(prompt), centroid_d)  → (d, cos), "other" if cos < min_similarity

μ is the mean of the per-domain means; W = S^{-1/2} with S the pooled within-domain covariance
of e, shrunk towards a scaled identity by ``shrinkage``: cosine nearest-centroid in the
LDA-whitened space. Why whitened: every prompt shares the chat-template tokens and most of the
embedding's variance is common to all text, so plain centroids are nearly parallel; whitening
removes that shared part (``tests/algo/test_domains.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

OTHER_DOMAIN = "other"
"""Returned by ``classify`` when no centroid is at least ``min_similarity`` similar."""


def embed_tokens(unit_embeddings: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``normalise(mean_t H(token_t))``: [hidden] fp32; the mean-pooled prompt embedding."""
    if unit_embeddings.ndim != 2:
        raise ValueError(f"unit_embeddings must be [vocab, hidden], got {tuple(unit_embeddings.shape)}")
    if len(token_ids) == 0:
        raise ValueError("cannot classify an empty token sequence")
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)  # [num_tokens]
    vocab_size = unit_embeddings.shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    pooled = unit_embeddings[ids].to(torch.float32).mean(0)  # [hidden]
    return pooled / pooled.norm().clamp_min(1e-12)


@dataclass(frozen=True, slots=True)
class DomainClassifier:
    """Cosine nearest-centroid in a whitened embedding space; see the module docstring."""

    unit_embeddings: torch.Tensor
    """[vocab, hidden] target input embedding with unit rows (``routing.normalise_embeddings``)."""
    domains: tuple[str, ...]
    """Domain names, in the order of ``centroids``' rows."""
    center: torch.Tensor
    """[hidden] μ: mean of the per-domain mean embeddings."""
    whitening: torch.Tensor
    """[hidden, hidden] W = S^{-1/2} of the shrunk pooled within-domain covariance."""
    centroids: torch.Tensor
    """[num_domains, hidden] unit centroids of the whitened, centred training embeddings."""
    min_similarity: float = 0.0
    """Below this best cosine the prompt is ``other`` (routing then uses the global prior).
    Centring on the domain-balanced mean makes the best cosine almost never negative, so 0.0
    means "always a domain"; few real prompts score below 0.2."""

    @classmethod
    def fit(cls, unit_embeddings: torch.Tensor, sequences_by_domain: Mapping[str, Sequence[Sequence[int]]],
            *, shrinkage: float = 0.5, min_similarity: float = 0.0) -> "DomainClassifier":
        """Fit from domain-labelled token sequences (e.g. ``Datastore.sequences`` per domain).

        ``shrinkage`` λ in [0, 1]: 1 = no whitening (centred cosine), 0 = full within-domain
        whitening (needs many more sequences than hidden dimensions); 0.5 suits both the datastore
        and the prompt-file fit.
        """
        if not 0.0 <= shrinkage <= 1.0:
            raise ValueError(f"shrinkage={shrinkage}: use a value in [0, 1]")
        if not sequences_by_domain:
            raise ValueError("no domains to fit: give {domain: [token_ids, ...]} with at least one domain")
        domains = tuple(sequences_by_domain)
        if OTHER_DOMAIN in domains:
            raise ValueError(f"{OTHER_DOMAIN!r} is reserved for unmatched prompts; rename that domain")
        features: list[torch.Tensor] = []
        for domain in domains:
            seqs = [s for s in sequences_by_domain[domain] if len(s) > 0]
            if not seqs:
                raise ValueError(f"domain {domain!r} has no non-empty token sequences")
            features.append(torch.stack([embed_tokens(unit_embeddings, s) for s in seqs]))  # [n_d, hidden]
        domain_means = torch.stack([f.mean(0) for f in features])  # [num_domains, hidden]
        center = domain_means.mean(0)  # [hidden]
        residuals = torch.cat([f - m for f, m in zip(features, domain_means)])  # [n, hidden]
        hidden = residuals.shape[1]
        within = residuals.T @ residuals / residuals.shape[0]  # [hidden, hidden]
        scale = max(float(within.diagonal().mean()), 1e-8)
        shrunk = (1.0 - shrinkage) * within + shrinkage * scale * torch.eye(hidden)
        eigenvalues, eigenvectors = torch.linalg.eigh(shrunk.double())
        eigenvalues = eigenvalues.clamp_min(scale * 1e-6)
        whitening = (eigenvectors @ torch.diag(eigenvalues.rsqrt()) @ eigenvectors.T).float()
        centroids = torch.stack([_unit(((f - center) @ whitening).mean(0)) for f in features])
        return cls(unit_embeddings, domains, center, whitening, centroids, float(min_similarity))

    def similarities(self, token_ids: Sequence[int]) -> dict[str, float]:
        """Cosine of the prompt to every domain centroid (in the whitened space)."""
        z = _unit((embed_tokens(self.unit_embeddings, token_ids) - self.center) @ self.whitening)
        return dict(zip(self.domains, (self.centroids @ z).tolist()))

    def classify(self, token_ids: Sequence[int]) -> tuple[str, float]:
        """(domain, cosine) of the most similar centroid, or (``other``, cosine) below the floor."""
        sims = self.similarities(token_ids)
        best = max(self.domains, key=sims.__getitem__)  # first of equals: domain order
        return (best if sims[best] >= self.min_similarity else OTHER_DOMAIN), sims[best]


def accuracy_by_domain(classifier: DomainClassifier,
                       sequences_by_domain: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, float]:
    """Share of each domain's sequences classified as that domain (for reports and tests)."""
    out = {}
    for domain, seqs in sequences_by_domain.items():
        if not seqs:
            raise ValueError(f"domain {domain!r} has no sequences to measure")
        out[domain] = sum(classifier.classify(s)[0] == domain for s in seqs) / len(seqs)
    return out


def _unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm(dim=-1, keepdim=True).clamp_min(1e-12)
