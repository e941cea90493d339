"""A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``) for a test: run as
a script, it starts a head and one worker node with the resources given as JSON, prints
``{"address": ...}`` on one line, and holds the cluster until its stdin closes (then shuts it
down). A process of its own, so the test process stays on the session's one cluster.

    python two_node_cluster.py '{"CPU": 2, "datacenter_gpu": 2}' '{"CPU": 2, "consumer_gpu": 8}'
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from ray.cluster_utils import Cluster

    head, worker = (json.loads(a) for a in sys.argv[1:3])
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": head.pop("CPU"), "resources": head, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=worker.pop("CPU"), resources=worker)
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address}), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
