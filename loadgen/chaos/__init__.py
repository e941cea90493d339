"""``cosine-loadgen chaos``: kill parts of a server at random under load and prove nothing was lost.

Like the rest of loadgen it never imports cosine_ray or Ray: it talks HTTP to the server and
reads and signals processes of this machine. The pieces, in the order a run uses them:

    cluster.py  a multi-node Ray cluster on this machine (``ray start``), for the node fault
    deploy.py   launch (or join) the server; list the deployment's processes
    procs.py    /proc: processes, their roles (from Ray's process titles), RSS/PSS
    shapes.py   request shapes (API features: n, stop, logprobs, JSON schema, tools)
    references.py  greedy references from an independent run (HF transformers, fp32)
    traffic.py  one call → one outcome, its id sent as X-Request-Id
    server_ledger.py  the server's record of the ids it answered, read during the run
    faults.py   the fault kinds and the injector (SIGKILL, SIGSTOP/SIGCONT, a node's death)
    run.py      warm-up, closed-loop clients, a fault every K s, recovery measured, memory sampled
    audit.py    the verdict: both ledgers matched (lost, duplicated), hung, wrong text, 5xx, failures
    memory.py   memory samples, per-process and per-role slopes, a footprint snapshot
    report.py   chaos.json, ledger.jsonl, calls.jsonl, memory.csv, chaos.png, printed tables
    cli.py      the ``chaos`` and ``footprint`` subcommands
"""
