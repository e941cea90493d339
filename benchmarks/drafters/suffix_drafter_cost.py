"""Cost of the suffix drafter per request-step, and its memory, at 10^5 and 10^6 indexed tokens.

Text: an order-2 Markov chain fitted on the packaged datastores, so n-gram frequencies look like
model text. The global index gets N tokens of such requests; then held-out requests (a third of
them repeating an ingested one) are decoded step by step, 3 verified tokens a step, timing
``propose`` (budget 8), ``continue_chains`` after it (``chains``) and as a step's first call
(``alone``). Times are the calling thread's CPU time, which a shared machine's preemption does
not inflate. ``--compare`` also measures the memory of a pure-Python suffix trie and the
datastore's n-gram dict on a small corpus.

    python benchmarks/drafters/suffix_drafter_cost.py [--sizes 100000 1000000] [--steps 300] [--compare]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from cosine_ray.engine.build import PACKAGED_DATASTORES
from cosine_ray.engine.drafters.base import ContinueQuery, DraftInput
from cosine_ray.engine.drafters.lookup.datastore import ContinuationIndex, Datastore
from cosine_ray.engine.drafters.lookup.suffix import SuffixConfig, SuffixDrafter

DATASTORES = PACKAGED_DATASTORES / "smollm2-135m"


def markov_sampler(seed: int):
    """A function drawing ``n`` tokens from an order-2 Markov chain (order-1 back-off)."""
    seqs = [s for p in sorted(DATASTORES.glob("*.parquet")) for s in Datastore.load(p).sequences]
    order2: dict[tuple[int, int], list[int]] = {}
    order1: dict[int, list[int]] = {}
    for s in seqs:
        for i in range(2, len(s)):
            order2.setdefault((s[i - 2], s[i - 1]), []).append(s[i])
            order1.setdefault(s[i - 1], []).append(s[i])
    starts = [s[:2] for s in seqs if len(s) > 2]
    rng = random.Random(seed)

    def sample(n: int) -> list[int]:
        out = list(rng.choice(starts))
        while len(out) < n:
            nxt = order2.get((out[-2], out[-1])) or order1.get(out[-1]) or [rng.choice(starts)[0]]
            out.append(rng.choice(nxt))
        return out[:n]
    return sample


def requests(sample, num_tokens: int, rng: random.Random) -> list[tuple[list[int], int]]:
    out, total = [], 0
    while total < num_tokens:
        prompt_len, output_len = rng.randint(30, 90), rng.randint(120, 360)
        out.append((sample(prompt_len + output_len), prompt_len))
        total += output_len + min(prompt_len, 32)
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(size: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    sample = markov_sampler(seed)
    corpus = requests(sample, size, rng)
    drafter = SuffixDrafter(SuffixConfig(max_indexed_tokens=size, max_cached_requests=10**6))
    t0 = time.perf_counter()
    for tokens, prompt_len in corpus:
        drafter.ingest(tokens, prompt_len=prompt_len)
    ingest_s = time.perf_counter() - t0
    held_out = requests(sample, 40_000, rng)
    held_out = [corpus[rng.randrange(len(corpus) // 2, len(corpus))] if i % 3 == 0 else r
                for i, r in enumerate(held_out)]
    gc.collect()
    gc.freeze()  # the benchmark's own corpus lists are not the drafter's: keep them out of GC passes
    times = {"propose": [], "chains": [], "chains_only": []}
    accepted, drafted, done = 0, 0, 0
    while done < steps:
        for r, (tokens, prompt_len) in enumerate(held_out):
            for cut in range(prompt_len, len(tokens) - 8, 3):
                if done >= steps:
                    break
                context = tuple(tokens[:cut])
                rid = f"q{r}"
                t0 = time.thread_time()
                (proposal,) = drafter.propose([DraftInput(rid, context, 8)])
                t1 = time.thread_time()
                (chains,) = drafter.continue_chains([ContinueQuery(rid, context, ((), (tokens[cut],)), 1, depth=8)])
                t2 = time.thread_time()
                times["propose"].append(t1 - t0)
                times["chains"].append(t2 - t1)
                if proposal.paths:
                    path = proposal.paths[0]
                    drafted += len(path)
                    accepted += next((i for i, t in enumerate(path) if t != tokens[cut + i]), len(path))
                done += 1
            drafter.release(f"q{r}")
            if done >= steps:
                break
    # The same steps again, continue_chains first (anchor not cached).
    done = 0
    for r, (tokens, prompt_len) in enumerate(held_out):
        for cut in range(prompt_len, len(tokens) - 8, 3):
            if done >= steps:
                break
            context = tuple(tokens[:cut])
            t0 = time.thread_time()
            drafter.continue_chains([ContinueQuery(f"c{r}", context, ((), (tokens[cut],)), 1, depth=8)])
            times["chains_only"].append(time.thread_time() - t0)
            done += 1
        drafter.release(f"c{r}")
        if done >= steps:
            break
    state = drafter.state_size()
    gc.unfreeze()
    return {"size": size, "ingest_tok_per_s": state["global_tokens"] / ingest_s, "state": state,
            "times": times, "accepted": accepted, "drafted": drafted}


def alternatives_memory(num_tokens: int, depth: int) -> list[tuple[str, float]]:
    """Bytes per indexed token of the alternatives, by tracemalloc, on ``num_tokens``."""
    sample = markov_sampler(1)
    corpus = requests(sample, num_tokens, random.Random(1))
    seqs = [t[p:] for t, p in corpus]
    n = sum(len(s) for s in seqs)
    out = []

    tracemalloc.start()
    trie: dict = {}
    for s in seqs:  # every suffix, depth-capped: node = {token: [count, children]}
        for i in range(len(s)):
            node = trie
            for t in s[i:i + depth]:
                entry = node.get(t)
                if entry is None:
                    entry = node[t] = [0, {}]
                entry[0] += 1
                node = entry[1]
    out.append((f"Python suffix trie, depth {depth}", tracemalloc.get_traced_memory()[0] / n))
    del trie
    tracemalloc.stop()

    tracemalloc.start()
    index = ContinuationIndex(seqs, 8)
    out.append(("n-gram tuple dict (datastore), n <= 8", tracemalloc.get_traced_memory()[0] / n))
    del index
    tracemalloc.stop()

    drafter = SuffixDrafter(SuffixConfig(max_indexed_tokens=10**7))
    for s in seqs:
        drafter.ingest(s)
    out.append(("SuffixIndex (buffer + 3 hash chains)", drafter.state_size()["global_bytes"] / n))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()

    print("per request-step, µs of CPU: propose = DraftInput budget 8 (indexes the new tokens, finds the")
    print("anchor); chains = continue_chains depth 8, 2 prefixes, after propose; alone = the same as the")
    print("step's first call; step = propose + chains")
    print(f"{'indexed':>9} {'requests':>8} {'memory':>8} {'B/tok':>5} {'ingest':>9} | {'propose':^11} | "
          f"{'chains':^9} | {'alone':^11} | {'step':^5} | {'accepted/':>9}")
    print(f"{'tokens':>9} {'':>8} {'MiB':>8} {'':>5} {'tok/s':>9} | {'p50':>4} {'p99':>6} | {'p50':>3} {'p99':>5} | "
          f"{'p50':>4} {'p99':>6} | {'mean':>5} | {'drafted':>9}")
    for size in args.sizes:
        r = measure(size, args.steps, args.seed)
        t = {k: [x * 1e6 for x in v] for k, v in r["times"].items()}
        st = r["state"]
        step = statistics.mean(a + b for a, b in zip(t["propose"], t["chains"]))
        print(f"{st['global_tokens']:>9,} {st['global_sequences']:>8,} {st['global_bytes'] / 2**20:>8.1f} "
              f"{st['global_bytes'] / st['global_tokens']:>5.0f} {r['ingest_tok_per_s']:>9,.0f} | "
              f"{statistics.median(t['propose']):>4.0f} {percentile(t['propose'], 0.99):>6.0f} | "
              f"{statistics.median(t['chains']):>3.0f} {percentile(t['chains'], 0.99):>5.0f} | "
              f"{statistics.median(t['chains_only']):>4.0f} {percentile(t['chains_only'], 0.99):>6.0f} | "
              f"{step:>5.0f} | {r['accepted'] / max(r['drafted'], 1):>9.2f}")
    if args.compare:
        print("\nmemory per indexed token (10^4 output tokens, tracemalloc):")
        for name, per_token in alternatives_memory(10_000, 32):
            print(f"  {name:<40} {per_token:>8.0f} B")


if __name__ == "__main__":
    main()
