"""verify_greedy / verify_keyed: greedy tables, determinism, and losslessness by
statistics; verify_keyed also commits exactly the plain keyed samples whatever the tree.

``GREEDY_CASES`` is layer-independent (a tree as token paths and the target as a map from
context to next token) so engine-level tests can replay it through a fake target model.
"""

import functools
import itertools
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo import verify as verify_module
from cosine_ray.algo.sampling import logits_to_probs, sample_keyed
from cosine_ray.algo.verify import VerifyResult, verify_greedy, verify_keyed

GREEDY_VOCAB = 8

# Each case: draft ``paths`` under ``root``; ``target_next`` maps the draft tokens after the root
# (a node's token path) to the target's argmax there; expected accepted tokens and bonus.
GREEDY_CASES = [
    dict(name="perfect_match", root=0, paths=[[1, 2, 3]],
         target_next={(): 1, (1,): 2, (1, 2): 3, (1, 2, 3): 4},
         accepted=[1, 2, 3], bonus=4),
    dict(name="early_mismatch", root=0, paths=[[1, 2, 3]],
         target_next={(): 1, (1,): 5, (1, 2): 3, (1, 2, 3): 4},
         accepted=[1], bonus=5),
    dict(name="first_token_mismatch", root=0, paths=[[1, 2, 3]],
         target_next={(): 6, (1,): 2, (1, 2): 3, (1, 2, 3): 4},
         accepted=[], bonus=6),
    dict(name="root_only", root=5, paths=[],
         target_next={(): 3},
         accepted=[], bonus=3),
    dict(name="second_child_matches", root=0, paths=[[1, 2], [3, 4]],
         target_next={(): 3, (1,): 2, (1, 2): 1, (3,): 4, (3, 4): 5},
         accepted=[3, 4], bonus=5),
    dict(name="branch_dead_end", root=0, paths=[[1, 2], [1, 3]],
         target_next={(): 1, (1,): 4, (1, 2): 5, (1, 3): 6},
         accepted=[1], bonus=4),
    dict(name="deep_tree", root=7, paths=[[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 1], [2]],
         target_next={(): 1, (1,): 2, (1, 2): 5, (1, 2, 3): 4, (1, 2, 3, 4): 0, (1, 2, 5): 6,
                      (1, 2, 5, 6): 7, (1, 7): 1, (1, 7, 1): 2, (2,): 3},
         accepted=[1, 2, 5, 6], bonus=7),
]


def build_greedy_case(case):
    """(tree, target_logits # [num_nodes, vocab]) for a GREEDY_CASES entry."""
    tree = TokenTree.from_paths(case["root"], case["paths"])
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(tree.num_nodes, GREEDY_VOCAB, generator=gen)  # [num_nodes, vocab]
    for node in range(tree.num_nodes):
        path = tuple(tree.token_ids[n] for n in tree.path_to(node)[1:])
        target_logits[node, case["target_next"][path]] = 10.0
    return tree, target_logits


@pytest.mark.parametrize("ids", [False, True], ids=["logits", "argmax ids"])
@pytest.mark.parametrize("case", GREEDY_CASES, ids=lambda c: c["name"])
def test_verify_greedy_table(case, ids):
    """From the logits, or from the argmax ids the last stage returns for greedy requests."""
    tree, target_logits = build_greedy_case(case)
    result = verify_greedy(tree, target_logits.argmax(-1) if ids else target_logits)
    assert list(result.accepted_token_ids) == case["accepted"]
    assert result.bonus_token_id == case["bonus"]
    assert result.accepted_length == len(case["accepted"]) + 1
    assert result.new_token_ids == (*case["accepted"], case["bonus"])
    # The node ids are a root-to-leaf path carrying the accepted tokens.
    if result.accepted_node_ids:
        assert tree.path_to(result.accepted_node_ids[-1])[1:] == list(result.accepted_node_ids)
    assert [tree.token_ids[n] for n in result.accepted_node_ids] == case["accepted"]


def test_verify_greedy_ties_take_first_max():
    tree = TokenTree.from_paths(0, [[2], [1]])
    target_logits = torch.tensor([[0.0, 3.0, 3.0, 0.0], [0.0] * 4, [0.0] * 4])
    result = verify_greedy(tree, target_logits)
    assert result.accepted_token_ids == (1,)
    assert result.accepted_node_ids == (2,)
    assert result.bonus_token_id == 0


def test_verify_result_properties_and_dummy():
    dummy = VerifyResult.make_dummy()
    assert dummy.accepted_length == 3 and dummy.new_token_ids == (10, 12, 14)
    tree = TokenTree.make_dummy()  # root -> 10 -> 12 -> 13, root -> 11
    target_logits = torch.zeros(tree.num_nodes, 16)
    target_logits[[0, 1, 3, 4], [10, 12, 14, 15]] = 1.0  # "x" (13) rejected at node 3
    assert verify_greedy(tree, target_logits) == dummy
    with pytest.raises(AttributeError):
        dummy.bonus_token_id = 1  # frozen


def test_shape_checks():
    tree = TokenTree.make_dummy()
    with pytest.raises(AssertionError):
        verify_greedy(tree, torch.zeros(4, 16))


# ---- seeded determinism and edge cases ----------------------------------------------------

def _random_case(seed: int, vocab: int = 6):
    rng = random.Random(seed)
    paths = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    tree = TokenTree.from_paths(0, paths)
    gen = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(torch.randn(tree.num_nodes, vocab, generator=gen), -1)
    draft_probs = [None] + [torch.softmax(torch.randn(vocab, generator=gen), -1) if rng.random() < 0.5
                            else None for _ in range(tree.num_draft_tokens)]
    return tree, target_probs, draft_probs


# ---- statistical losslessness ---------------------------------------------------------------
#
# A tiny "language": vocab 5, target distribution a fixed function of the whole context (so the
# second token's distribution depends on the first). A decode loop runs verify rounds until two
# tokens are emitted; the histogram of (token 1, token 2) over N trials must match
# p(a) * p(b | a) (K = 25 outcomes) for every drafter, however adversarial.
#
# Tolerance: E[TV] <= 0.5 * sum_k sqrt(p_k / N) <= 0.5 * sqrt(K / N), and TV moves by at most 1/N
# per trial, so by McDiarmid P(TV > E[TV] + t) <= exp(-2 N t^2). With bound sqrt(K / N),
# t >= 0.5 sqrt(K / N) and the false-alarm probability is <= exp(-K / 2) = 4e-6 per check.

STAT_VOCAB = 5
TOKENS = range(STAT_VOCAB)
NUM_OUTCOMES = STAT_VOCAB ** 2


def _target_table(seed: int = 0) -> dict[tuple[int, ...], torch.Tensor]:
    """p(· | context) for every context of length <= 3 (rounds reach depth 2 after one token)."""
    gen = torch.Generator().manual_seed(seed)
    table = {}
    for length in range(4):
        for context in itertools.product(range(STAT_VOCAB), repeat=length):
            probs = 0.85 * torch.softmax(1.5 * torch.randn(STAT_VOCAB, generator=gen), -1) + 0.15 / STAT_VOCAB
            if torch.rand((), generator=gen) < 0.5:  # some tokens the target never emits
                probs[int(torch.randint(STAT_VOCAB, (), generator=gen))] = 0.0
            table[context] = probs / probs.sum()
    return table


TARGET = _target_table()
EXACT = torch.stack([TARGET[()][a] * TARGET[(a,)][b] for a in range(STAT_VOCAB)
                     for b in range(STAT_VOCAB)]).double().numpy()  # [K]


def _away_probs(target_probs: torch.Tensor) -> torch.Tensor:
    """A draft distribution concentrated on the tokens the target likes least."""
    weights = (target_probs.max() - target_probs + 0.02) ** 3
    return weights / weights.sum()


AWAY = {context: _away_probs(probs) for context, probs in TARGET.items()}
ASCENDING = {context: torch.argsort(probs, stable=True).tolist() for context, probs in TARGET.items()}


def _ascending(context) -> list[int]:
    return ASCENDING[context]


@functools.cache
def _conditional(context: tuple[int, ...], taken: frozenset[int]) -> tuple[list[float], torch.Tensor]:
    """The away-distribution at ``context`` with the ``taken`` tokens removed (list, tensor)."""
    cond = AWAY[context].clone()
    cond[list(taken)] = 0.0
    cond /= cond.sum()
    return cond.tolist(), cond


def _draw(rng: random.Random, context, taken=frozenset()) -> tuple[int, torch.Tensor]:
    """x ~ away-distribution without ``taken`` (sampling without replacement); also its q."""
    weights, cond = _conditional(context, taken)
    return rng.choices(TOKENS, weights=weights)[0], cond


# Drafters: context -> (draft paths, {token path: draft distribution or None}). Their random
# choices use their own ``random.Random``, independent of the verifier's generator.

def draft_least_likely_chain(context, rng):
    """Deterministic chain of the target's two least likely tokens (often probability 0)."""
    x1 = _ascending(context)[0]
    return [[x1, _ascending(context + (x1,))[0]]], {}


def draft_away_chain(context, rng):
    """Chain sampled from q far from p, verified with the q-rule."""
    x1, q1 = _draw(rng, context)
    x2, q2 = _draw(rng, context + (x1,))
    return [[x1, x2]], {(x1,): q1, (x1, x2): q2}


def draft_mixed_siblings(context, rng):
    """Three siblings: the least likely token (point mass), then two sampled from q without
    replacement (q-rule with that conditional q); each has one q-sampled child."""
    first_tokens, draft_rows = [_ascending(context)[0]], {}
    for _ in range(2):
        x1, q1 = _draw(rng, context, frozenset(first_tokens))
        first_tokens.append(x1)
        draft_rows[(x1,)] = q1
    paths = []
    for x1 in first_tokens:
        x2, q2 = _draw(rng, context + (x1,))
        paths.append([x1, x2])
        draft_rows[(x1, x2)] = q2
    return paths, draft_rows


def draft_bushy_least_likely(context, rng):
    """Depth-2 tree: the three least likely tokens, each with its two least likely children."""
    return [[x1, x2] for x1 in _ascending(context)[:3] for x2 in _ascending(context + (x1,))[:2]], {}


def draft_random_tree(context, rng):
    """A fresh random tree every trial (0-3 children, each with 0-2 children), point masses."""
    paths = []
    for x1 in rng.sample(range(STAT_VOCAB), rng.randint(0, 3)):
        kids = rng.sample(range(STAT_VOCAB), rng.randint(0, 2))
        paths += [[x1, x2] for x2 in kids] or [[x1]]
    return paths, {}


_ROUND_CACHE: dict = {}


def _round_inputs(drafter, context, paths, draft_rows):
    """(tree, target_probs # [num_nodes, vocab], draft_probs) for one verify round. Cached per
    drafter: its draft rows are a function of (context, paths), sibling order included."""
    key = (drafter.__name__, context, tuple(map(tuple, paths)))
    if key not in _ROUND_CACHE:
        tree = TokenTree.from_paths(context[-1] if context else 0, paths)
        node_paths = [tuple(tree.token_ids[n] for n in tree.path_to(node)[1:])
                      for node in range(tree.num_nodes)]
        target_probs = torch.stack([TARGET[context + p] for p in node_paths])
        draft_probs = [draft_rows.get(p) for p in node_paths] if draft_rows else None
        _ROUND_CACHE[key] = (tree, target_probs, draft_probs)
    return _ROUND_CACHE[key]


def tv_distance(outcomes: np.ndarray) -> float:
    freq = np.bincount(outcomes, minlength=NUM_OUTCOMES) / len(outcomes)
    return 0.5 * float(np.abs(freq - EXACT).sum())


def tv_bound(num_trials: int) -> float:
    return (NUM_OUTCOMES / num_trials) ** 0.5


def chisquare_pvalue(outcomes: np.ndarray) -> float:
    counts = np.bincount(outcomes, minlength=NUM_OUTCOMES)
    support = EXACT > 0
    if counts[~support].any():  # an impossible sequence was emitted
        return 0.0
    expected = EXACT[support] / EXACT[support].sum() * len(outcomes)
    return float(stats.chisquare(counts[support], expected).pvalue)


LOSSLESS_DRAFTERS = [draft_least_likely_chain, draft_away_chain, draft_mixed_siblings,
                     draft_bushy_least_likely, draft_random_tree]


# ==============================================================================================
# verify_keyed: the committed tokens are the plain keyed samples, whatever the tree
# ==============================================================================================
#
# Convention under test: the root (last committed token) sits at ``root_position``; row u (the
# target's distribution after node u, depth d) draws the token of position root_position + d + 1
# with ``sample_keyed``'s noise for that position.

def toy_target(table_seed: int, vocab: int, top_k: int = 0):
    """p(. | token path after the root): a fixed function of the path (a toy language model)."""
    @functools.cache
    def probs_of(path: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        gen = torch.Generator().manual_seed(zlib.crc32(repr((table_seed, path)).encode()))
        logits = 1.5 * torch.randn(1, vocab, generator=gen)  # [1, vocab]
        return logits_to_probs(logits, temperature=1.0, top_k=top_k)[0]
    return probs_of


def tree_rows(tree: TokenTree, probs_of) -> torch.Tensor:  # [num_nodes, vocab]
    return torch.stack([probs_of(tuple(tree.token_ids[n] for n in tree.path_to(node)[1:]))
                        for node in range(tree.num_nodes)])


def plain_keyed_decode(probs_of, *, seed: int, root_position: int, num_tokens: int) -> list[int]:
    """Decoding without speculation: token k after the root is the keyed sample of position
    root_position + k given the tokens before it."""
    path: tuple[int, ...] = ()
    for k in range(1, num_tokens + 1):
        row = probs_of(path)[None]  # [1, vocab]
        path += (int(sample_keyed(row, seed=seed, positions=[root_position + k])[0]),)
    return list(path)


def check_verify_keyed_is_plain_decode(tree: TokenTree, probs_of, seed: int, root_position: int) -> VerifyResult:
    result = verify_keyed(tree, tree_rows(tree, probs_of), seed=seed, root_position=root_position)
    max_depth = max(tree.depths())
    plain = plain_keyed_decode(probs_of, seed=seed, root_position=root_position, num_tokens=max_depth + 1)
    node_paths = {tuple(tree.token_ids[n] for n in tree.path_to(node)[1:]) for node in range(tree.num_nodes)}
    accepted = max(m for m in range(max_depth + 1) if tuple(plain[:m]) in node_paths)
    assert result.new_token_ids == tuple(plain[:accepted + 1]), (result, plain)
    assert result.accepted_length == accepted + 1
    if result.accepted_node_ids:  # a root path carrying the accepted tokens
        assert tree.path_to(result.accepted_node_ids[-1])[1:] == list(result.accepted_node_ids)
    return result


paths_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=0, max_size=8)


@settings(max_examples=300, deadline=None)
@given(paths=paths_strategy, seed=st.integers(-2**63, 2**64), root_position=st.integers(0, 2**40),
       table_seed=st.integers(0, 1000), top_k=st.sampled_from([0, 2]), root=st.integers(0, 3))
def test_verify_keyed_commits_the_plain_keyed_decode(paths, seed, root_position, table_seed, top_k, root):
    """Random trees over a 4-token vocabulary (so they often hold the sampled path), random
    distributions with and without zeros: the step commits the plain decode's next tokens."""
    check_verify_keyed_is_plain_decode(TokenTree.from_paths(root, paths), toy_target(table_seed, 4, top_k),
                                       seed, root_position)


def test_verify_keyed_trees_with_and_without_the_sampled_path():
    vocab = 6
    for seed in range(40):
        probs_of, position = toy_target(seed, vocab), 10 + seed
        plain = plain_keyed_decode(probs_of, seed=seed, root_position=position, num_tokens=6)
        wrong = [(t + 1) % vocab for t in plain]
        cases = {
            "holds the path": ([plain[:4], [wrong[0], 1, 2], plain[:2] + [wrong[2]]], 4),
            "holds a prefix": ([plain[:2] + [wrong[2], plain[3]]], 2),
            "misses the first token": ([[t] + plain[1:3] for t in range(vocab) if t != plain[0]], 0),
            "root only": ([], 0),
        }
        greedy_path, path = [], ()  # what a greedy drafter proposes: the target's argmax chain
        for _ in range(5):
            greedy_path.append(int(probs_of(path).argmax()))
            path += (greedy_path[-1],)
        greedy_accepted = next((m for m in range(5) if greedy_path[m] != plain[m]), 5)
        cases["greedy chain"] = ([greedy_path], greedy_accepted)
        for name, (paths, num_accepted) in cases.items():
            tree = TokenTree.from_paths(plain[0] if name == "root only" else 0, paths)
            result = check_verify_keyed_is_plain_decode(tree, probs_of, seed, position)
            assert result.accepted_token_ids == tuple(plain[:num_accepted]), (name, seed)
            assert result.bonus_token_id == plain[num_accepted], (name, seed)


def test_verify_keyed_position_convention(monkeypatch):
    """Row u draws position root_position + depth(u) + 1; each position's noise is made once,
    only for the depths the walk reaches (one vector per committed token)."""
    probs_of = toy_target(7, 5)
    for seed in range(20):
        root_position = 1000 + seed
        # root only: the bonus is the keyed sample of the next position
        result = verify_keyed(TokenTree.root_only(3), probs_of(())[None], seed=seed, root_position=root_position)
        assert result.bonus_token_id == int(sample_keyed(probs_of(())[None], seed=seed,
                                                         positions=[root_position + 1])[0])
    made = []
    original = verify_module.keyed_exponentials

    def recording(seed, position, vocab):
        made.append(position)
        return original(seed, position, vocab)

    monkeypatch.setattr(verify_module, "keyed_exponentials", recording)
    plain = plain_keyed_decode(probs_of, seed=5, root_position=40, num_tokens=4)
    wrong = (plain[0] + 1) % 5
    tree = TokenTree.from_paths(0, [[wrong, 1, 2], plain[:3], [(plain[0] + 2) % 5]])  # siblings at depth 1
    result = verify_keyed(tree, tree_rows(tree, probs_of), seed=5, root_position=40)
    assert result.new_token_ids == tuple(plain[:4]) and made == [41, 42, 43, 44]
    made.clear()
    tree = TokenTree.from_paths(0, [[wrong, 1, 2]])
    result = verify_keyed(tree, tree_rows(tree, probs_of), seed=5, root_position=40)
    assert result.new_token_ids == (plain[0],) and made == [41]


def test_verify_keyed_depends_on_seed_and_position():
    probs_of = toy_target(3, 8)
    tree = TokenTree.from_paths(0, [[1, 2], [3]])
    rows = tree_rows(tree, probs_of)
    by_seed = {verify_keyed(tree, rows, seed=s, root_position=9).new_token_ids for s in range(60)}
    by_position = {verify_keyed(tree, rows, seed=1, root_position=p).new_token_ids for p in range(60)}
    assert len(by_seed) > 3 and len(by_position) > 3
    again = [verify_keyed(tree, rows, seed=s, root_position=9).new_token_ids for s in range(60)]
    assert set(again) == by_seed


@pytest.mark.parametrize("case", GREEDY_CASES, ids=lambda c: c["name"])
def test_verify_keyed_with_one_hot_target_equals_greedy(case):
    tree, target_logits = build_greedy_case(case)
    target_probs = logits_to_probs(target_logits, temperature=0.0)
    expected = verify_greedy(tree, target_logits)
    for seed in range(10):
        assert verify_keyed(tree, target_probs, seed=seed, root_position=seed * 7) == expected


def test_verify_keyed_checks_and_leaves_inputs_alone():
    tree = TokenTree.make_dummy()
    with pytest.raises(AssertionError):
        verify_keyed(tree, torch.full((4, 16), 1 / 16), seed=0, root_position=0)
    with pytest.raises(AssertionError):
        verify_keyed(tree, torch.full((5,), 0.2), seed=0, root_position=0)
    with pytest.raises(ValueError):
        verify_keyed(tree, torch.full((5, 16), 1 / 16), seed=0, root_position=-1)
    with pytest.raises(ValueError):  # the root row is no distribution
        verify_keyed(tree, torch.zeros(5, 16), seed=0, root_position=0)
    tree, target_probs, _ = _random_case(3)
    before = target_probs.clone()
    for seed in range(20):
        verify_keyed(tree, target_probs, seed=seed, root_position=seed)
    assert torch.equal(target_probs, before)


# ---- verify_keyed: statistical losslessness over seeds -----------------------------------------
#
# A decode loop with keyed verification: trial i is a request with seed i
# and a 3-token prompt (the first tree's root at position 2; each round's root is the last
# committed token). The drafters are the adversarial ones above (their draft distributions are
# ignored: keyed verification needs none). The tolerance is the one derived above.

KEYED_PROMPT_LENGTH = 3
KEYED_TRIALS = 10_000


def emitted_pairs_keyed(verifier, drafter, num_trials: int) -> np.ndarray:  # [num_trials]
    rng = random.Random(1)  # the drafters' own randomness
    outcomes = np.empty(num_trials, dtype=np.int64)
    for trial in range(num_trials):
        context: tuple[int, ...] = ()
        while len(context) < 2:
            tree, target_probs, _ = _round_inputs(drafter, context, *drafter(context, rng))
            result = verifier(tree, target_probs, seed=trial,
                              root_position=KEYED_PROMPT_LENGTH - 1 + len(context))
            context += result.new_token_ids
        outcomes[trial] = context[0] * STAT_VOCAB + context[1]
    return outcomes


@pytest.mark.full  # a statistical sweep
@pytest.mark.parametrize("drafter", LOSSLESS_DRAFTERS, ids=lambda d: d.__name__)
def test_verify_keyed_emits_target_distribution(drafter):
    outcomes = emitted_pairs_keyed(verify_keyed, drafter, KEYED_TRIALS)
    assert tv_distance(outcomes) < tv_bound(KEYED_TRIALS), (tv_distance(outcomes), tv_bound(KEYED_TRIALS))
    assert chisquare_pvalue(outcomes) > 1e-4


def verify_keyed_relative_positions(tree, target_probs, *, seed, root_position):
    """WRONG (a plausible bug): keys the noise by depth in the tree, not by absolute position,
    so a round that commits one token reuses that token's noise for the next one."""
    return verify_keyed(tree, target_probs, seed=seed, root_position=0)


def test_wrong_keyed_verifier_fails_the_same_check():
    num_trials = 4_000
    outcomes = emitted_pairs_keyed(verify_keyed_relative_positions, draft_least_likely_chain, num_trials)
    assert tv_distance(outcomes) > tv_bound(num_trials)
    assert chisquare_pvalue(outcomes) < 1e-4
