"""Starting the application for ``cosine-ray serve``: the model, placement, Serve, the deploy.

``fetch_model``: the model resolved; what must be fetched or converted is, in a child process of
its own (``python -m cosine_ray.models.loader``), so this long-lived process never holds torch.
``place_actors``: a stage no node can host is a CliError naming it, what it asks and what the
nodes offer; a drafter that cannot be placed is left out of the plan, with a note.
``ServeStart``: Serve's start in a thread, so that the application deploys while Serve's HTTP
proxy starts.

``deploy_in_child`` runs this module as a child (``main``), which imports Serve's client and
joins the cluster while the CLI process (the Ray driver that waits for Ctrl-C) starts it and
Serve (``Deployer``: started first). The child reads ``{"address", "app_args", "name",
"route_prefix", "error_file", "env", "logging_config", "log_level"}`` as JSON on stdin
(nothing: it exits 0), joins the cluster, runs ``serve.run`` and exits 0 once the application
answers; on failure it writes one line (``failure_reason``) to ``error_file`` and exits 1. The
application outlives it. Neither process imports torch or the engine: ``build_app`` names the
engine's class by import path, and only the engine replica imports it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from cosine_ray.cli.args import CliError

ServePlan = Any
"""``cli.serve.ServePlan`` (not imported: ``cli.serve`` imports this module)."""


def fetch_model(engine: dict[str, Any], where: str = "") -> None:
    """The model (and its tokenizer) resolved; what must be fetched or converted first is, once,
    in a child process (``python -m cosine_ray.models.loader``: its download and conversion
    progress bars go to this terminal), so that this process, which runs for as long as the
    server, never imports torch, transformers or huggingface_hub. CliError (one line) when it
    cannot be."""
    from cosine_ray.models.loader import cached_checkpoint
    source = {k: engine.get(k) for k in ("revision", "tokenizer", "download_dir")}
    try:
        if cached_checkpoint(engine["model"], **source) is not None:
            return  # nothing to fetch or convert: resolved here, without torch
    except (ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        raise CliError(where + str(exc).splitlines()[0]) from None
    cmd = [sys.executable, "-m", "cosine_ray.models.loader", str(engine["model"])]
    for key in ("revision", "tokenizer", "download_dir"):
        if engine.get(key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(engine[key])]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if proc.returncode != 0 or "error" in answer:
        raise CliError(where + str(answer.get("error") or f"resolving the model failed (exit {proc.returncode})"))


def place_actors(plan: ServePlan) -> ServePlan:
    """``plan`` without the drafters no node can host (a note for each); CliError for a stage."""
    from cosine_ray.engine.config import config_from_dict, config_to_dict
    from cosine_ray.runtime.placement import PlacementError, check_placement, cluster_nodes, without_drafters

    config = config_from_dict(plan.engine)
    try:
        unplaceable = check_placement(config, cluster_nodes())
    except PlacementError as exc:
        raise CliError(f"{exc}; give the nodes these resources, or change cluster.use_resources / "
                       f"num_cpus_per_actor / --stages") from None
    if not unplaceable:
        return plan
    for ask, why in unplaceable:
        print(f"cosine-ray: note: serving without {ask.what}: {why}", file=sys.stderr, flush=True)
    engine = config_to_dict(without_drafters(config, [ask.drafter_index for ask, _ in unplaceable]))
    ingress = {k: v for k, v in plan.app_args.items() if k not in plan.engine}
    return dataclasses.replace(plan, engine=engine, app_args={**engine, **ingress})


class ServeStart:
    """``serve.start(**options)`` in a thread. ``serve.start`` returns once every HTTP proxy
    answers (a new process that imports Serve), but the deploy needs only the controller:
    ``wait_for_controller`` returns as soon as the controller actor exists, so the application's
    replicas start beside the proxy rather than after it (the proxy routes to them once both are
    up). ``result`` waits for the start and raises what it raised."""

    def __init__(self, **options: Any) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(options,), name="serve-start", daemon=True).start()

    def _run(self, options: dict[str, Any]) -> None:
        from ray import serve
        try:
            serve.start(**options)
        except BaseException as exc:  # raised again by result(), in the caller's thread
            self.error = exc
        finally:
            self.done.set()

    def wait_for_controller(self, poll_s: float = 0.05) -> None:
        """Until Serve's controller actor exists or the start ended (failed or done)."""
        import ray
        try:
            from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        except ImportError:  # a Serve without these names: wait for the whole start
            self.done.wait()
            return
        while not self.done.wait(poll_s):
            try:
                ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                return
            except Exception:  # not created yet (ValueError), or the lookup failed: ask again
                continue

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def serve_start_error(config_path: str | None, exc: BaseException) -> BaseException:
    """What ``serve.start`` raised, as the CLI's one line: bad HTTP settings (pydantic's
    ValidationError is a ValueError) name the file; anything else, such as a proxy that never
    answered, says so. Not an Exception (KeyboardInterrupt): raised as it is."""
    if not isinstance(exc, Exception):
        return exc
    first = (str(exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, ValueError):
        where = f"--config {config_path}: " if config_path else ""
        return CliError(f"{where}Serve settings: {first}")
    return CliError(f"Serve's HTTP proxy did not start: {type(exc).__name__}: {first}")


class Deployer:
    """The deploying child, started early so that its imports (Serve's client: a second or
    two) overlap the local cluster's and Serve's start; it waits on stdin for the
    spec. ``cancel`` kills it while it imports, waits or deploys (a start that failed first, or
    Ctrl-C during the start: ``deploy`` then returns the kill's status at once)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cosine_ray.cli.serve_start"], stdin=subprocess.PIPE,
                                     text=True)
        self.cancelled = False

    def deploy(self, spec: dict[str, Any]) -> int:
        if self.cancelled:
            return self.proc.wait()
        try:
            self.proc.communicate(json.dumps(spec))
        except (BrokenPipeError, ValueError):  # cancelled while the spec was being written
            pass
        return self.proc.wait()

    def cancel(self) -> None:
        """Kill the child if it still runs (a no-op once it deployed); safe in a signal handler."""
        self.cancelled = True
        if self.proc.poll() is None:
            self.proc.kill()


def deploy_in_child(plan: ServePlan, deployer: Deployer) -> None:
    """``serve.run`` of the application in ``deployer``'s child process (``main``) on the cluster
    this process is connected to; CliError with the child's one-line reason if the application
    did not start."""
    import ray

    address = ray.get_runtime_context().gcs_address
    with tempfile.NamedTemporaryFile("r", suffix=".err", encoding="utf-8") as err:
        # what ray.init set in this process's environment after the child started (RAY_AUTH_MODE
        # for the cluster's token authentication), which a child started now would inherit
        ray_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
        spec = {"address": address, "app_args": plan.app_args, "name": plan.app_name,
                "route_prefix": plan.route_prefix, "error_file": err.name, "env": ray_env,
                "logging_config": plan.console.app_logging(), "log_level": plan.console.system_level}
        returncode = deployer.deploy(spec)
        if returncode != 0:
            reason = err.read().strip() or f"the deploying process exited with {returncode}"
            raise CliError(f"the application did not start: {reason}")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the CLI's to handle: it kills this child
    from ray import serve

    from cosine_ray.runtime.cluster import connect
    from cosine_ray.serve.app import build_app

    text = sys.stdin.read()  # imports first, while the parent starts the cluster; then the spec
    if not text.strip():
        return 0  # cancelled: the parent stopped before deploying
    spec = json.loads(text)
    try:
        os.environ.update(spec.get("env", {}))
        if os.environ.get("RAY_AUTH_MODE"):  # Ray read its config when imported: read it again
            from ray._raylet import Config

            Config.initialize("")
        # the CLI prints the workers' lines; this process printing them too doubled each one
        connect(spec["address"], logging_level=spec.get("log_level"), log_to_driver=False)
        if spec.get("log_level"):  # Serve's own lines in this process ("Connecting to existing Serve app")
            logging.getLogger("ray.serve").setLevel(spec["log_level"])
        serve.run(build_app(spec["app_args"]), name=spec["name"], route_prefix=spec["route_prefix"],
                  logging_config=spec.get("logging_config"), blocking=False)
    except Exception as exc:  # a replica that cannot start, a bad setting: one line for the CLI
        with open(spec["error_file"], "w", encoding="utf-8") as f:
            f.write(failure_reason(serve, spec["name"], exc)[:1000])
        return 1
    return 0


def failure_reason(serve, app_name: str, exc: Exception) -> str:
    """The last line of a failed deployment's own message (its replica's exception, e.g.
    ``ValueError: no datastore at ...``), else of the exception ``serve.run`` raised."""
    def last(text: str) -> str | None:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else None

    try:
        app = serve.status().applications.get(app_name)
        for deployment in (app.deployments.values() if app else []):
            if str(deployment.status).endswith(("UNHEALTHY", "DEPLOY_FAILED")) and deployment.message:
                return last(deployment.message) or ""
    except Exception:  # the status is a nicety: fall back to the exception
        pass
    return last(str(exc)) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
