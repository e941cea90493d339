"""``cosine-loadgen hostile``: a library of hostile requests fired at a server, one at a time,
each with an ordinary greedy stream (the bystander) beside it.

    cases.py   the requests: huge schemas, n=16 floods, 20,000 messages, 70,000 logit_bias
               entries, bad numbers, a body sent a byte at a time, a stream nobody reads, ...
    run.py     per case: the bystander, the deadline, the normal request after it, the verdict
    report.py  the table (status, time, the bystander's longest gap, the request after) and
               hostile.json / hostile.md
    cli.py     the flags

HTTP only (httpx and raw sockets), like the rest of loadgen: any OpenAI-compatible server.
"""
