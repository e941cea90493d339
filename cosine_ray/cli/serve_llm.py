"""``cosine-ray serve --config FILE`` of Ray Serve LLM's shape: a Serve config whose application
is ``cosine_ray.serve.app:build_llm_app`` (or ``build_app``) with ``llm_configs`` in its args, or
a file holding those args alone.

Each entry of ``llm_configs`` is a model with its own engine settings (``serve.llm_configs``), so
the flags that set engine settings do not apply (one line, exit 2, if given); the ingress flags
(keys, limits), the HTTP flags and ``--address`` do. Every model's checkpoint and device are
checked before Ray starts, its placement once the cluster is up.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from cosine_ray.cli.args import CliError, check_local_device

LLM_APP_IMPORT_PATHS = ("cosine_ray.serve.app:build_llm_app", "cosine_ray.serve.app.build_llm_app")
"""How a Serve config names the Ray Serve LLM builder (``build_app`` takes the same args)."""
BUILDER_KEYS = ("llm_configs", "ingress_deployment_config", "ingress_cls_config")
"""Keys of the builder's args that are not ingress args."""


def split_llm_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the builder's own keys, the ingress args) of Ray Serve LLM-shaped args."""
    return ({k: v for k, v in args.items() if k in BUILDER_KEYS},
            {k: v for k, v in args.items() if k not in BUILDER_KEYS})


def check_no_engine_flags(args: argparse.Namespace, engine_data: Callable[..., dict[str, Any]],
                          empty_file: Any) -> None:
    """CliError when a flag sets an engine setting: ``engine_data`` (``cli.serve._engine_data``)
    of the flags over an empty file must be the defaults (``--address`` aside), and the flags
    naming what a model is (``--model``, ``--drafters``, ``--stages``) must not be given at all."""
    from cosine_ray.engine.config import config_from_dict, config_to_dict

    flagged = engine_data(args, empty_file)
    defaults = config_to_dict(config_from_dict({}))
    flagged["cluster"] = {**flagged["cluster"], "address": None}
    changed = sorted({k for k in flagged if flagged[k] != defaults.get(k)}
                     | {k for k in ("model", "drafters", "stages") if getattr(args, k, None) is not None})
    if changed:
        raise CliError(f"engine flags ({', '.join(changed)}) do not apply to a config with llm_configs: set them "
                       "in each model's engine_kwargs")


def llm_models(config_path: str, builder: dict[str, Any], ingress: dict[str, Any], address: str | None) -> list:
    """The models of the builder args (``serve.llm_configs.EngineDeployment``), each checkpoint
    resolved and each device checked here (``--address``: the cluster's devices, not ours)."""
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.models.loader import resolve_checkpoint
    from cosine_ray.serve.app import INGRESS_ARGS
    from cosine_ray.serve.llm_configs import parse_builder_config

    try:
        models, _, _ = parse_builder_config({**builder, **ingress}, INGRESS_ARGS)
        for model in models:
            resolve_checkpoint(model.config_data["model"])  # fail fast with a clear message (and fetch it once)
    except (ValueError, OSError) as exc:
        raise CliError(f"--config {config_path}: {str(exc).splitlines()[0]}") from None
    if not address:
        for model in models:
            check_local_device(config_from_dict(model.config_data).device)
    return models


def first_engine(models: list, address: str | None) -> dict[str, Any]:
    """The first model's resolved engine data, what the CLI's cluster checks read (with
    ``--address`` as its cluster address)."""
    from cosine_ray.engine.config import config_from_dict, config_to_dict

    data = config_to_dict(config_from_dict(models[0].config_data))
    data["cluster"]["address"] = address
    return data


def place_models(models: list) -> None:
    """CliError for a model whose stages no node of the cluster can host; a note for each
    drafter that cannot be placed (its engine serves without it)."""
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.runtime.placement import PlacementError, check_placement, cluster_nodes

    nodes = cluster_nodes()
    for model in models:
        name = (model.names or ["?"])[0]
        try:
            unplaceable = check_placement(config_from_dict(model.config_data), nodes)
        except PlacementError as exc:
            raise CliError(f"model {name}: {exc}; give the nodes these resources, or change its engine_kwargs "
                           "(cluster.use_resources, num_cpus_per_actor, num_stages)") from None
        for ask, why in unplaceable:
            print(f"cosine-ray: note: model {name} serves without {ask.what}: {why}", file=sys.stderr, flush=True)
