"""SuffixDrafter and SuffixIndex: suffix matching over per-request and global token buffers.

The oracle is brute force: every occurrence of every suffix length found by scanning the
sequences, the paper's selection (each match length's greedy path, capped and cut, scored by
the sum of its cumulative probabilities; best of local and global) computed from scratch.
"""

from __future__ import annotations

import random

import pytest

from cosine_ray.engine.drafters.base import ContinueQuery, DraftFeedback, DraftInput, Drafter, continue_chains
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.drafters.lookup.suffix import SuffixConfig, SuffixDrafter
from cosine_ray.engine.drafters.lookup.suffix_index import SuffixIndex

UNCAPPED = dict(max_occurrences=100_000)
"""Chains read to the end: counts are exact, as brute force computes them."""


# ---- brute-force reference ---------------------------------------------------------------------

def reference_windows(sequences, tail, match_len):
    """Continuations (rest of the sequence) after each occurrence of ``tail[-match_len:]``,
    most recent first; ``sequences`` = [(token_ids, first continuation position)], oldest first."""
    key = list(tail[-match_len:])
    out = []
    for token_ids, first in sequences:
        for p in range(max(first, match_len), len(token_ids)):
            if list(token_ids[p - match_len:p]) == key:
                out.append(list(token_ids[p:]))
    return out[::-1]


def reference_walk(windows, max_len, min_prob, smoothing, prefix=()):
    """Greedy path below the node at ``prefix``: (path, probabilities, score, children)."""
    rows, cumulative = windows, 1.0
    for t, tok in enumerate(prefix):
        counts = _counts(rows, t)
        if t >= max_len or tok not in counts:
            return [], [], 0.0, []
        cumulative *= counts[tok] / (sum(counts.values()) + smoothing)
        rows = [w for w in rows if len(w) > t and w[t] == tok]
    t0 = len(prefix)
    counts = _counts(rows, t0) if t0 < max_len else {}
    denominator = sum(counts.values()) + smoothing
    children = [(tok, c / denominator) for tok, c in sorted(counts.items(), key=lambda kv: -kv[1])
                if cumulative * (c / denominator) >= min_prob]
    path, probs, score = [], [], 0.0
    for t in range(t0, max_len):
        counts = _counts(rows, t)
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: kv[1])  # first maximum = most recent
        prob = c / (sum(counts.values()) + smoothing)
        if cumulative * prob < min_prob:
            break
        cumulative *= prob
        score += cumulative
        path.append(tok)
        probs.append(prob)
        rows = [w for w in rows if len(w) > t and w[t] == tok]
    return path, probs, score, children


def _counts(rows, t):
    counts: dict[int, int] = {}
    for w in rows:
        if len(w) > t:
            counts[w[t]] = counts.get(w[t], 0) + 1
    return counts


def reference_anchor(context, global_sequences, cfg):
    """(windows, max_len) of the best node: every match length of local then global."""
    tail = list(context[-cfg.max_depth:])
    best = None
    for sequences in ([(list(context), 0)], global_sequences):
        best_here = None
        for match_len in range(len(tail), cfg.min_match_len - 1, -1):
            windows = reference_windows(sequences, tail, match_len)
            if not windows:
                continue
            max_len = cfg.max_draft_len(match_len)
            score = reference_walk(windows, max_len, cfg.min_token_prob, cfg.count_smoothing)[2]
            if score > (best_here[0] if best_here else 0.0):
                best_here = (score, windows, max_len)
        if best_here and (best is None or best_here[0] > best[0]):
            best = best_here
    return best


def stored(sequences_with_prompt_lens, num_prompt_context_tokens):
    """What ``ingest`` keeps: the prompt's last tokens as context, then the output."""
    out = []
    for tokens, prompt_len in sequences_with_prompt_lens:
        kept = min(prompt_len, num_prompt_context_tokens)
        if prompt_len < len(tokens):
            out.append((list(tokens[prompt_len - kept:]), kept))
    return out


def propose_one(drafter, context, budget, request_id="r0"):
    (proposal,) = drafter.propose([DraftInput(request_id, tuple(context), budget)])
    assert proposal.request_id == request_id and proposal.drafter == drafter.name
    return proposal


def check_invariants(proposal, budget, cfg):
    assert proposal.num_draft_tokens <= max(budget, 0)
    assert len(proposal.paths) == len(proposal.confidences)
    assert all(p and len(p) == len(c) <= cfg.max_spec_tokens for p, c in zip(proposal.paths, proposal.confidences))
    firsts = [p[0] for p in proposal.paths]
    assert len(set(firsts)) == len(firsts) <= cfg.max_branches
    assert all(0.0 <= c <= 1.0 for confs in proposal.confidences for c in confs)


# ---- the index against brute force --------------------------------------------------------------

def test_index_finds_every_occurrence_and_match_length():
    rng = random.Random(0)
    for trial in range(150):
        vocab = rng.choice([2, 3, 5, 12])
        sequences = []
        index = SuffixIndex((1, 3, 8), max_depth=12, **UNCAPPED)
        for _ in range(rng.randint(1, 5)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
            first = rng.randint(0, len(tokens)) if rng.random() < 0.3 else 0
            index.add_sequence(tokens, num_context_tokens=first)
            sequences.append((tokens, first))
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        positions, lengths = index.find(tail)
        got = sorted((n, index.token_at(p)) for p, n in zip(positions, lengths))
        want = []
        for tokens, first in sequences:
            for p in range(max(first, 1), len(tokens)):
                n = 0
                while n < min(12, len(tail)) and p - 1 - n >= 0 and tokens[p - 1 - n] == tail[-1 - n]:
                    n += 1
                if n:
                    want.append((n, tokens[p]))
        assert got == sorted(want), trial
        assert positions == sorted(positions, reverse=True)


def test_each_key_length_finds_only_its_own_occurrences():
    # Thousands of distinct keys share a few thousand hash buckets: collisions must be dropped.
    rng = random.Random(8)
    index = SuffixIndex((1, 3, 8), max_depth=12, **UNCAPPED)
    sequences = [[rng.randrange(40) for _ in range(300)] for _ in range(10)]
    for tokens in sequences:
        index.add_sequence(tokens)
    for trial in range(50):
        tail = rng.choice(sequences)[:rng.randint(8, 300)]
        for level, k in enumerate(index.key_lengths):
            positions, lengths = index.find_level(tail, level)
            want = sorted(tokens[p] for tokens in sequences for p in range(k, len(tokens))
                          if tokens[p - k:p] == tail[-k:])
            assert sorted(index.token_at(p) for p in positions) == want, (trial, k)
            assert min(lengths, default=k) >= k


def test_index_caps_each_key_at_its_most_recent_occurrences():
    index = SuffixIndex((1,), max_depth=4, max_occurrences=5)
    tokens = [t for i in range(20) for t in (7, 100 + i)]  # 7 → 100, 7 → 101, ...
    index.add_sequence(tokens)
    positions, lengths = index.find([3, 7])
    assert [index.token_at(p) for p in positions] == [119, 118, 117, 116, 115]
    assert lengths == [1] * 5
    assert SuffixIndex((1,), max_depth=4, max_occurrences=50).find([7]) == ([], [])


# ---- the drafter against brute force ------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    SuffixConfig(max_depth=10, key_lengths=(1, 3, 6), max_branches=1, **UNCAPPED),
    SuffixConfig(max_depth=10, key_lengths=(1, 3, 6), max_branches=1, count_smoothing=1.0,
                 min_token_prob=0.05, max_spec_factor=0.5, max_spec_offset=2.0, **UNCAPPED),
    SuffixConfig(max_depth=8, key_lengths=(2, 5), min_match_len=2, max_branches=1, min_token_prob=0.3,
                 max_spec_tokens=6, num_prompt_context_tokens=3, **UNCAPPED),
])
def test_drafts_follow_the_best_scoring_node(cfg):
    rng = random.Random(1)
    num_checked = 0
    for trial in range(120):
        vocab = rng.choice([2, 3, 4, 8])
        drafter = SuffixDrafter(cfg)
        ingested = []
        for _ in range(rng.randint(0, 4)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            prompt_len = rng.randint(0, len(tokens))
            drafter.ingest(tokens, prompt_len=prompt_len)
            ingested.append((tokens, prompt_len))
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        best = reference_anchor(context, stored(ingested, cfg.num_prompt_context_tokens), cfg)
        proposal = propose_one(drafter, context, cfg.max_spec_tokens, f"r{trial}")
        (answers,) = drafter.continue_drafts([ContinueQuery(f"r{trial}", tuple(context), ((),), k=3)])
        if best is None:
            assert proposal.paths == [] and answers == [[]]
            continue
        _, windows, max_len = best
        path, probs, _, children = reference_walk(windows, max_len, cfg.min_token_prob, cfg.count_smoothing)
        assert proposal.paths == ([path] if path else []), trial
        assert proposal.confidences == ([probs] if path else [])
        assert answers == [children[:3]]
        if path:  # one level down, off the greedy token when there is another child
            tok = children[-1][0]
            (answers,) = drafter.continue_drafts([ContinueQuery(f"r{trial}", tuple(context), ((tok,),), k=2)])
            assert answers == [reference_walk(windows, max_len, cfg.min_token_prob, cfg.count_smoothing,
                                              prefix=(tok,))[3][:2]]
            num_checked += 1
    assert num_checked > 30


def test_longer_match_wins_over_frequent_short_one():
    # "4 5" is followed by 9 three times, but the longer match "1 2 3 4 5" by 6.
    context = [4, 5, 9, 4, 5, 9, 1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 9, 0, 1, 2, 3, 4, 5]
    proposal = propose_one(SuffixDrafter(SuffixConfig(max_branches=1)), context, 8)
    assert proposal.paths == [[6, 7, 8, 4, 5]]  # the match has length 5: at most 5 tokens
    assert proposal.confidences == [[1.0] * 5]


# ---- length cap and probability cut ---------------------------------------------------------

@pytest.mark.parametrize("factor, offset, max_spec, want_len", [
    (1.0, 0.0, 16, 3), (2.0, 0.0, 16, 6), (1.0, 2.0, 16, 5), (2.0, 0.0, 4, 4), (0.5, 0.0, 16, 1),
])
def test_draft_length_follows_the_match_length(factor, offset, max_spec, want_len):
    continuation = list(range(20, 40))
    context = [1, 2, 3] + continuation + [9, 1, 2, 3]  # longest earlier match: "1 2 3", once
    cfg = SuffixConfig(max_spec_factor=factor, max_spec_offset=offset, max_spec_tokens=max_spec)
    proposal = propose_one(SuffixDrafter(cfg), context, 32)
    assert proposal.paths == [continuation[:want_len]]


def test_probability_cut_stops_paths():
    # After "1 2 3": 10 twice, 11, 12 (p(10) = 1/2); after "1 2 3 10": 20 or 21 (1/2 each).
    drafter_rows = [[1, 2, 3, 10, 20, 30, 40], [1, 2, 3, 11], [1, 2, 3, 12], [1, 2, 3, 10, 21, 31, 41]]

    def drafted(min_prob):
        drafter = SuffixDrafter(SuffixConfig(min_token_prob=min_prob, max_branches=1, max_spec_factor=4.0))
        drafter.ingest_many(drafter_rows)
        return propose_one(drafter, [7, 1, 2, 3], 8)

    assert drafted(0.3).paths == [[10]]
    assert drafted(0.3).confidences == [[0.5]]
    # 21 is the more recent of the tied continuations; the cumulative probability stays 1/4.
    assert drafted(0.2).paths == [[10, 21, 31, 41]]
    assert drafted(0.2).confidences == [[0.5, 0.5, 1.0, 1.0]]
    assert drafted(0.6).paths == []


def test_count_smoothing_discounts_single_occurrences():
    drafter = SuffixDrafter(SuffixConfig(count_smoothing=1.0, min_token_prob=0.2))
    proposal = propose_one(drafter, [5, 6, 7, 8, 9, 5, 6, 7], 8)
    assert proposal.paths == [[8, 9]]  # 1/2, then 1/4; 1/8 is below the cut
    assert proposal.confidences == [[0.5, 0.5]]


# ---- branching and budget -------------------------------------------------------------------------

def test_branches_take_distinct_first_tokens_and_share_the_budget():
    rows = [[1, 2, 3, 10, 20, 30], [1, 2, 3, 10, 20, 30], [1, 2, 3, 11, 21, 31]]
    cfg = SuffixConfig(max_branches=2, max_spec_factor=4.0)
    drafter = SuffixDrafter(cfg)
    drafter.ingest_many(rows)
    wide = propose_one(drafter, [1, 2, 3], 8)
    assert wide.paths == [[10, 20, 30], [11, 21, 31]]
    assert wide.confidences == [[pytest.approx(2 / 3), 1.0, 1.0], [pytest.approx(1 / 3), 1.0, 1.0]]
    # Budget 4: the nodes of cumulative probability 2/3 (three) beat branch 11's 1/3.
    assert propose_one(drafter, [1, 2, 3], 4).paths == [[10, 20, 30], [11]]
    assert propose_one(drafter, [1, 2, 3], 3).paths == [[10, 20, 30]]
    single = SuffixDrafter(SuffixConfig(max_branches=1, max_spec_factor=4.0))
    single.ingest_many(rows)
    assert propose_one(single, [1, 2, 3], 8).paths == [[10, 20, 30]]


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 5, 8, 16])
def test_budget_respected_and_confidences_are_probabilities(budget):
    rng = random.Random(budget)
    cfg = SuffixConfig(max_branches=3, max_spec_tokens=6, min_token_prob=0.0, count_smoothing=0.5)
    drafter = SuffixDrafter(cfg)
    drafter.ingest_many([[rng.randrange(4) for _ in range(50)] for _ in range(5)])
    num_nonempty = 0
    for trial in range(30):
        context = [rng.randrange(4) for _ in range(rng.randint(0, 80))]
        proposal = propose_one(drafter, context, budget, f"r{trial % 4}")
        check_invariants(proposal, budget, cfg)
        num_nonempty += bool(proposal.paths)
    assert num_nonempty == 0 if budget == 0 else num_nonempty > 20


# ---- per-request state --------------------------------------------------------------------------

def test_incremental_updates_equal_a_rebuild():
    rng = random.Random(2)
    tokens = [rng.randrange(5) for _ in range(400)]
    cfg = SuffixConfig(max_branches=2)
    incremental = SuffixDrafter(cfg)
    length = 3
    while length <= len(tokens):
        context = tokens[:length]
        fresh = SuffixDrafter(cfg)
        got, want = propose_one(incremental, context, 8), propose_one(fresh, context, 8)
        assert (got.paths, got.confidences) == (want.paths, want.confidences)
        assert incremental._states["r0"].index.find(context) == fresh._states["r0"].index.find(context)
        length += rng.randint(1, 9)


def test_non_extension_context_rebuilds():
    drafter = SuffixDrafter()
    propose_one(drafter, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 4)
    other = [9, 8, 7, 9, 8]  # same request id, unrelated context
    assert propose_one(drafter, other, 4).paths == [[7, 9]] == propose_one(SuffixDrafter(), other, 4).paths
    assert propose_one(drafter, [9, 8], 4).paths == []  # shorter (rolled back)
    assert propose_one(drafter, [9, 8, 6, 9, 8], 4).paths == [[6, 9]]  # diverged, same length


def test_release_frees_state_and_tracking_is_lru():
    drafter = SuffixDrafter(SuffixConfig(max_tracked_requests=2))
    propose_one(drafter, [1, 2, 1] * 20, 2, "a")
    propose_one(drafter, [1, 2, 1], 2, "b")
    assert drafter.num_tracked_requests == 2 == drafter.state_size()["requests"]
    assert drafter.state_size()["local_tokens"] == 63
    drafter.observe([DraftFeedback("a", 2, 1)])
    drafter.release("a")
    drafter.release("a")  # idempotent
    drafter.release("never-seen")
    assert drafter.num_tracked_requests == 1
    assert drafter.state_size()["local_tokens"] == 3
    for rid in ("b", "c", "b", "d"):
        propose_one(drafter, [1, 2, 1], 2, rid)
    assert set(drafter._states) == {"b", "d"}  # "c" was least recently used
    drafter.release("b")
    drafter.release("d")
    assert drafter.state_size()["requests"] == 0 and drafter.state_size()["local_bytes"] == 0


# ---- the global index --------------------------------------------------------------------------

def test_repeated_request_is_drafted_from_the_first_ones_output():
    rng = random.Random(3)
    prompt = [rng.randrange(5000) for _ in range(40)]
    output = [rng.randrange(5000) for _ in range(200)]
    drafter = SuffixDrafter()

    def decode(request_id):
        """Greedy verification of the first path: accepted draft tokens and verify steps."""
        generated, num_accepted, num_steps = [output[0]], 0, 0
        while len(generated) < len(output):
            proposal = propose_one(drafter, prompt + generated, 8, request_id)
            path = proposal.paths[0] if proposal.paths else []
            accepted = 0
            while accepted < len(path) and len(generated) + accepted < len(output) \
                    and path[accepted] == output[len(generated) + accepted]:
                accepted += 1
            generated += output[len(generated):len(generated) + accepted + 1]  # + bonus token
            num_accepted, num_steps = num_accepted + accepted, num_steps + 1
        drafter.release(request_id)
        return num_accepted, num_steps

    assert decode("first") == (0, 199)  # random text: nothing to draft from
    drafter.ingest(prompt + output, prompt_len=len(prompt))
    num_accepted, num_steps = decode("again")
    assert num_accepted >= 0.85 * len(output) and num_steps <= 25
    # The prompt itself is context only: its own continuations are never proposed.
    assert propose_one(drafter, prompt[:20], 8, "mid-prompt").paths == []
    assert propose_one(drafter, prompt, 8, "prompt").paths[0] == output[:8]


def test_best_of_local_and_global_wins():
    drafter = SuffixDrafter(SuffixConfig(max_branches=1))
    drafter.ingest([1, 2, 3, 4, 5, 50, 51, 52, 53, 54])
    # Local: "4 5" → 60 once (length 2); global: "1 2 3 4 5" → 50 … (length 5): global wins.
    assert propose_one(drafter, [4, 5, 60, 61, 1, 2, 3, 4, 5], 8, "a").paths == [[50, 51, 52, 53, 54]]
    # Local now matches longer ("9 1 2 3 4 5"): local wins.
    context = [9, 1, 2, 3, 4, 5, 70, 71, 72, 73, 74, 75, 9, 1, 2, 3, 4, 5]
    assert propose_one(drafter, context, 8, "b").paths == [[70, 71, 72, 73, 74, 75]]


def test_ingest_reaches_running_requests_at_their_next_call():
    drafter = SuffixDrafter(SuffixConfig(max_branches=1))
    context = (4, 5, 60, 61, 1, 2, 3, 4, 5)
    assert propose_one(drafter, context, 8).paths == [[60, 61]]  # local "4 5": two tokens
    drafter.ingest([1, 2, 3, 4, 5, 50, 51, 52, 53, 54])
    assert propose_one(drafter, context, 8).paths == [[50, 51, 52, 53, 54]]  # same context object


# ---- peers: requests in flight ------------------------------------------------------------------

def _random_text(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(5000) for _ in range(n)]


@pytest.mark.parametrize("use_local", [True, False])
def test_identical_request_in_flight_drafts_from_the_first_ones_output(use_local):
    """The global index learns a request only when it finishes: an identical request sent while
    the first is still writing drafts from the first one's context, and from nothing without peers."""
    prompt, output = _random_text(5, 40), _random_text(6, 120)
    for max_peers, want in ((8, output[20:28]), (0, None)):
        drafter = SuffixDrafter(SuffixConfig(max_branches=1, max_peers=max_peers, use_local=use_local))
        propose_one(drafter, prompt + output[:1], 8, "first")  # its first step: the drafter sees the prompt
        propose_one(drafter, prompt + output[:100], 8, "first")  # 100 tokens written so far
        propose_one(drafter, prompt + output[:1], 8, "again")
        paths = propose_one(drafter, prompt + output[:20], 8, "again").paths
        assert paths == ([want] if want else [])
        assert propose_one(drafter, prompt + output[:100], 8, "first").paths == []  # nothing ahead of it


def test_a_request_with_another_prompt_is_no_peer():
    """Peers share the prompt: another request in flight is not searched, even where it holds a
    long run of the asker's text, and an expert without a local index indexes nobody's context."""
    shared, rest = _random_text(7, 8), _random_text(8, 30)
    for use_local in (True, False):
        drafter = SuffixDrafter(SuffixConfig(max_branches=1, max_cached_requests=0, use_local=use_local))
        propose_one(drafter, _random_text(9, 20) + shared + rest, 8, "other")
        assert propose_one(drafter, _random_text(10, 20) + shared, 8, "asker").paths == []
        assert drafter.state_size()["local_tokens"] == (20 + 8 + 30 + 20 + 8 if use_local else 0)


def test_a_peer_gives_long_matches_only():
    """Within a prompt's peers, a match must be ``key_lengths[-1]`` (8) tokens long: a 5-token run
    the asker shares with its peer after their outputs part drafts nothing, an 8-token run does."""
    prompt, first, part, shared, after = (_random_text(s, n) for s, n in ((14, 30), (15, 1), (16, 10), (17, 8), (18, 10)))
    for overlap, want in ((5, []), (8, [after[:8]])):
        drafter = SuffixDrafter(SuffixConfig(max_branches=1, max_cached_requests=0))
        propose_one(drafter, prompt + first, 8, "peer")
        propose_one(drafter, prompt + first + part + shared + after, 8, "peer")
        propose_one(drafter, prompt + first, 8, "asker")
        context = prompt + first + _random_text(19, 10) + shared[8 - overlap:]
        assert propose_one(drafter, context, 8, "asker").paths == want


def test_peers_are_the_latest_with_the_prompt_and_a_released_one_is_gone():
    prompt, output = _random_text(11, 30), _random_text(12, 60)
    drafter = SuffixDrafter(SuffixConfig(max_branches=1, max_peers=1, max_cached_requests=0))
    for request_id, written in (("writer", 60), ("other", 5)):
        propose_one(drafter, prompt + output[:1], 8, request_id)
        propose_one(drafter, prompt + output[:written], 8, request_id)
    assert propose_one(drafter, prompt + output[:1], 8, "asker").paths == [output[1:5]]  # "other" only
    drafter.release("other")
    assert propose_one(drafter, prompt + output[:2], 8, "asker").paths == [output[2:10]]  # now "writer"
    drafter.release("writer")
    assert propose_one(drafter, prompt + output[:3], 8, "asker").paths == []
    assert drafter._by_origin.keys() == {hash(tuple(prompt))}  # only the asker's group is left
    drafter.release("asker")
    assert drafter._by_origin == {}


def test_eviction_bounds_memory_and_drops_oldest_first():
    rng = random.Random(4)
    cfg = SuffixConfig(max_indexed_tokens=2_000, max_cached_requests=15, num_prompt_context_tokens=0)
    drafter = SuffixDrafter(cfg)
    rows = [[rng.randrange(10_000) for _ in range(rng.randint(50, 150))] for _ in range(600)]
    sizes = []
    for i, row in enumerate(rows):
        drafter.ingest(row)
        size = drafter.state_size()
        assert size["global_tokens"] <= 2_000 and size["global_sequences"] <= 15
        sizes.append(size["global_bytes"])
    kept = drafter._global.sequences()
    num_kept = len(kept)
    assert [tokens for tokens, _ in kept] == rows[-num_kept:]  # the newest, oldest first
    assert max(sizes[100:]) <= 2 * sizes[100]  # bounded: no growth with the number ingested
    assert propose_one(drafter, rows[-1][:10], 4, "new").paths == [rows[-1][10:14]]
    assert propose_one(drafter, rows[0][:10], 4, "old").paths == []  # evicted
    by_count = SuffixDrafter(SuffixConfig(max_cached_requests=3))
    by_count.ingest_many(rows[:10])
    assert [t for t, _ in by_count._global.sequences()] == rows[7:10]
    # Evicted but not yet compacted away: the chains must still end at the live region.
    assert propose_one(by_count, rows[6][:10], 4).paths == []
    assert propose_one(by_count, rows[7][:10], 4).paths == [rows[7][10:14]]
    # Compaction shifts positions; chain pointers into the dropped prefix become -1 (no drift
    # that could wrap around int32 on a long-running server).
    index = drafter._global
    assert all(a.min() >= -1 for a in (*index._prev, *index._heads))


def test_global_index_can_be_turned_off():
    drafter = SuffixDrafter(SuffixConfig(max_cached_requests=0))
    drafter.ingest([1, 2, 3, 4, 5, 6])
    assert propose_one(drafter, [1, 2, 3], 4).paths == []
    assert drafter.state_size()["global_tokens"] == 0


def test_ingest_rejects_bad_input():
    drafter = SuffixDrafter()
    with pytest.raises(ValueError, match="prompt_len"):
        drafter.ingest([1, 2, 3], prompt_len=4)
    with pytest.raises(ValueError, match="negative"):
        drafter.ingest([1, -2, 3])
    drafter.ingest([1, 2, 3], prompt_len=3)  # no output: nothing stored
    assert drafter.state_size()["global_sequences"] == 0


def test_snapshot_round_trip(tmp_path):
    rng = random.Random(5)
    cfg = SuffixConfig(max_indexed_tokens=3_000)
    drafter = SuffixDrafter(cfg)
    for _ in range(40):
        tokens = [rng.randrange(50) for _ in range(rng.randint(20, 120))]
        drafter.ingest(tokens, prompt_len=rng.randint(0, 19))
    path = drafter.save(tmp_path / "suffix.parquet")
    loaded = SuffixDrafter.load(path, cfg)
    assert loaded._global.sequences() == drafter._global.sequences()
    assert loaded.state_size()["global_tokens"] == drafter.state_size()["global_tokens"] > 0
    for trial in range(20):
        context = [rng.randrange(50) for _ in range(30)]
        a, b = propose_one(drafter, context, 8, f"r{trial}"), propose_one(loaded, context, 8, f"r{trial}")
        assert (a.paths, a.confidences) == (b.paths, b.confidences)
    smaller = SuffixDrafter.load(path, SuffixConfig(max_cached_requests=5))  # caps apply on load
    assert smaller._global.sequences() == drafter._global.sequences()[-5:]
    with pytest.raises(ValueError, match="does not exist"):
        SuffixDrafter.load(tmp_path / "missing.parquet")
    Datastore.from_sequences([[1, 2]], domain="code", model_name="m").save(tmp_path / "ds.parquet")
    with pytest.raises(ValueError, match="not a suffix drafter snapshot"):
        SuffixDrafter.load(tmp_path / "ds.parquet")


def test_seeded_from_datastores():
    code = Datastore.from_sequences([[5, 6, 7, 8, 9, 10]], domain="code", model_name="m")
    math = Datastore.from_sequences([[1, 2, 3, 4]], domain="math", model_name="m")
    drafter = SuffixDrafter.from_datastore([code, math], SuffixConfig(max_spec_factor=2.0))
    assert drafter.state_size()["global_sequences"] == 2
    assert propose_one(drafter, [0, 5, 6, 7], 8).paths == [[8, 9, 10]]
    assert propose_one(drafter, [1, 2], 8).paths == [[3, 4]]


# ---- continue_drafts / continue_chains --------------------------------------------------------------

def test_continue_chains_equals_repeated_continue_drafts():
    rng = random.Random(6)
    drafter = SuffixDrafter(SuffixConfig(count_smoothing=0.5, min_token_prob=0.05))
    drafter.ingest_many([[rng.randrange(6) for _ in range(60)] for _ in range(6)])
    num_long = 0
    for trial in range(60):
        context = tuple(rng.randrange(6) for _ in range(rng.randint(0, 60)))
        prefixes = ((), (rng.randrange(6),), tuple(rng.randrange(6) for _ in range(3)))
        queries = [ContinueQuery(f"r{trial % 3}", context, prefixes, k=rng.randint(1, 3), depth=rng.randint(0, 7)),
                   ContinueQuery("other", context[:-1] or (1,), ((),), k=1, depth=5)]
        native = drafter.continue_chains(queries)
        assert native == continue_chains(drafter, queries)
        for q, chains in zip(queries, native):
            assert len(chains) == len(q.prefixes)
            for chain in chains:
                assert len(chain) <= q.depth and all(len(c) <= q.k for c in chain)
                assert all(0.0 <= prob <= 1.0 for c in chain for _, prob in c)
                num_long += len(chain) >= 3
    assert num_long > 20


def test_first_path_is_the_chain_of_top_tokens():
    rng = random.Random(7)
    cfg = SuffixConfig(max_branches=1, max_spec_tokens=8)
    drafter = SuffixDrafter(cfg)
    drafter.ingest_many([[rng.randrange(5) for _ in range(80)] for _ in range(4)])
    for trial in range(40):
        context = tuple(rng.randrange(5) for _ in range(rng.randint(1, 50)))
        proposal = propose_one(drafter, context, 8, f"r{trial}")
        (chains,) = drafter.continue_chains([ContinueQuery(f"r{trial}", context, ((),), k=1, depth=8)])
        chain = chains[0]
        top = [c[0][0] for c in chain if c]
        assert proposal.paths == ([top] if top else [])
        assert proposal.confidences == ([[c[0][1] for c in chain if c]] if top else [])


def test_is_a_drafter_with_name():
    drafter = SuffixDrafter()
    assert isinstance(drafter, Drafter)
    assert drafter.name == "suffix" and SuffixDrafter(name="suffix:code").name == "suffix:code"
    assert propose_one(drafter, [], 8).paths == []
    assert drafter.continue_drafts([ContinueQuery("r0", (), ((),))]) == [[[]]]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_depth": 0}, "max_depth"), ({"key_lengths": ()}, "key_lengths"), ({"key_lengths": (3, 1)}, "key_lengths"),
    ({"key_lengths": (1, 40)}, "max_depth"), ({"min_match_len": 0}, "min_match_len"),
    ({"key_lengths": (2, 4), "min_match_len": 1}, "min_match_len"), ({"max_occurrences": 0}, "max_occurrences"),
    ({"max_spec_tokens": 0}, "max_spec_tokens"), ({"max_spec_factor": -1.0}, "max_spec_factor"),
    ({"min_token_prob": 1.5}, "min_token_prob"), ({"max_branches": 0}, "max_branches"),
    ({"count_smoothing": -1.0}, "count_smoothing"), ({"max_cached_requests": -1}, "max_cached_requests"),
    ({"max_indexed_tokens": 0}, "max_indexed_tokens"), ({"num_prompt_context_tokens": -1}, "num_prompt_context"),
    ({"max_tracked_requests": 0}, "max_tracked_requests"), ({"max_peers": -1}, "max_peers"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SuffixConfig(**kwargs)


def test_the_engine_config_caps_every_suffix_index():
    """``runtime.suffix_index_tokens`` reaches every suffix drafter the engine builds: the
    packaged seeds (11-24 k tokens per domain) are cut to the cap, oldest rows first."""
    import types

    from cosine_ray.engine.build import build_drafter
    from cosine_ray.engine.config import EngineConfig, parse_drafters

    target = types.SimpleNamespace(name="smollm2-135m")
    specs = parse_drafters("suffix,suffix:code,suffix:chat")

    def sizes(config):
        return [build_drafter(s, target=target, target_state={}, target_tokenizer=None,
                              config=config).state_size()["global_tokens"] for s in specs]

    uncapped, capped = sizes(EngineConfig()), sizes(EngineConfig().replace(suffix_index_tokens=5_000))
    assert all(n > 5_000 for n in uncapped), uncapped
    assert all(0 < n <= 5_000 for n in capped), capped
    for bad in (0, -1, 2.5, True, "many"):
        with pytest.raises(ValueError, match="suffix_index_tokens must be an integer >= 1"):
            EngineConfig().replace(suffix_index_tokens=bad)
