"""Deploy the Serve application from a short-lived process (``cosine-ray serve`` runs this as a
child): binding the application imports its classes, and with them torch and the engine, which
the long-lived CLI process (the Ray driver that waits for Ctrl-C) then never needs to hold.

Reads ``{"address", "app_args", "name", "route_prefix", "error_file"}`` as JSON on stdin, joins
the cluster at ``address``, runs ``serve.run`` and exits 0 once the application answers; on
failure it writes one line (``failure_reason``) to ``error_file`` and exits 1.
The application outlives this process: Serve's controller owns its replicas.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.load(sys.stdin)
    from ray import serve

    from cosine_ray.runtime.cluster import connect
    from cosine_ray.serve.app import build_app

    try:
        connect(spec["address"])
        serve.run(build_app(spec["app_args"]), name=spec["name"], route_prefix=spec["route_prefix"],
                  blocking=False)
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
