"""cosine-loadgen: a speculation-aware load generator for any OpenAI-compatible server.

HTTP only (httpx); it never imports cosine_ray, so it drives vLLM, SGLang or cosine_ray alike.
The pieces, in the order a run uses them:

    workload.py  prompts by domain (dataset files or random tokens) → WorkItem list
    arrivals.py  seeded arrival offsets: Poisson, gamma burstiness, CoSine low/high/fluctuating
    client.py    one streamed request → RequestRecord (TTFT, ITL, tokens, stats block, errors)
    runner.py    schedules the plan, caps concurrency, keeps the ledger, shows progress
    ledger.py    proof that every request was sent/answered exactly once
    metrics.py   summary numbers (vllm bench serve names) + acceptance by domain and drafter
    report.py    JSON, Parquet, ledger JSONL and the printed table
    plots.py     PNG plots (matplotlib, Agg)
    launcher.py  start/stop a server process and wait for /health (compare --launch)
    compare.py   the same plan against several targets → one table normalised to a baseline
    chaos/       ``chaos``: faults under load, a ledger audit, memory over time (its __init__)
    hostile/     ``hostile``: hostile requests, each with a bystander stream beside it
    cli.py       ``cosine-loadgen run | compare | chaos | footprint | hostile``
"""
