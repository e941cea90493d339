"""``cosine-ray distill``'s flag defaults are the training configs' defaults: the parser writes
them out as literals (building it must not import torch, which ``distill.domain`` and
``distill.head`` do), so the two copies are held together here."""

from __future__ import annotations

import dataclasses

import pytest

from cosine_ray.cli import build_parser
from cosine_ray.distill.domain import DomainTrainConfig
from cosine_ray.distill.head import HeadTrainConfig

FLAGS = (  # (config class, its field, the parsed argument it comes from)
    (DomainTrainConfig, "vocab_size", "vocab_size"), (DomainTrainConfig, "epochs", "epochs"),
    (DomainTrainConfig, "lr", "lr"), (DomainTrainConfig, "batch_tokens", "batch_tokens"),
    (DomainTrainConfig, "shared_epochs", "shared_epochs"), (DomainTrainConfig, "shared_lr", "shared_lr"),
    (DomainTrainConfig, "seed", "seed"), (DomainTrainConfig, "threads", "threads"),
    (HeadTrainConfig, "vocab_size", "head_vocab_size"), (HeadTrainConfig, "epochs", "head_epochs"),
    (HeadTrainConfig, "lr", "head_lr"), (HeadTrainConfig, "batch_tokens", "head_batch_tokens"),
    (HeadTrainConfig, "seed", "seed"), (HeadTrainConfig, "threads", "threads"),
)


@pytest.mark.parametrize("cls, field, dest", FLAGS, ids=[f"{c.__name__}.{f}" for c, f, _ in FLAGS])
def test_a_flag_default_is_its_config_default(cls, field, dest):
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    assert getattr(build_parser().parse_args(["distill"]), dest) == defaults[field]
