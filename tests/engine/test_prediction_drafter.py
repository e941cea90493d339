"""The prediction drafter (``engine.drafters.prediction``) alone: anchors, re-anchoring after an
edit, draft lengths that follow the match, and nothing once released."""

from __future__ import annotations

from support.drafter_protocol import assert_speaks_drafter_protocol

from cosine_ray.engine.drafters.base import ContinueQuery, DraftInput, continue_chains
from cosine_ray.engine.drafters.prediction import PredictionConfig, PredictionDrafter

PROMPT = (900, 901, 902)
PREDICTION = tuple(range(100, 160))  # 60 distinct tokens


def chain(drafter, answer, prefixes=((),), depth=64, rid="r"):
    return drafter.continue_chains([ContinueQuery(rid, PROMPT + tuple(answer), tuple(prefixes), 1, depth)])[0]


def tokens(levels):
    """The chain's tokens; a chain shorter than its depth ends with an empty level."""
    assert all(levels[:-1]), levels
    return [level[0][0] for level in levels if level]


def make(**config):
    d = PredictionDrafter(PredictionConfig(**config))
    d.expect("r", len(PROMPT), PREDICTION)
    return d


def test_the_answer_starts_where_the_prediction_does():
    d = make(max_spec_tokens=16)
    levels = chain(d, ())[0]
    assert tokens(levels) == list(PREDICTION[:16])
    assert all(level[0][1] == d.config.start_confidence for level in levels if level)


def test_drafts_follow_the_prediction_and_grow_with_the_match():
    d = make(max_spec_factor=1.0, max_spec_offset=0.0, max_spec_tokens=64)
    short = chain(d, PREDICTION[:3])[0]
    assert tokens(short) == list(PREDICTION[3:6])  # a match of 3: 3 tokens
    long = chain(d, PREDICTION[:20])[0]
    assert tokens(long) == list(PREDICTION[20:40])  # a match of 20: 20 tokens
    assert long[0][0][1] > short[0][0][1]  # a longer match is more confident
    assert tokens(chain(d, PREDICTION[:50])[0]) == list(PREDICTION[50:])  # up to the prediction's end


def test_after_an_edit_it_waits_then_picks_the_prediction_up_again():
    d = make()
    edited = PREDICTION[:10] + (7, 8, 9)  # the answer left the prediction after 10 tokens
    assert chain(d, edited) == [[[]]]
    rejoined = edited + PREDICTION[14:17]  # ... and came back, 4 tokens further on
    assert tokens(chain(d, rejoined)[0])[:5] == list(PREDICTION[17:22])


def test_a_repeated_span_is_re_anchored_nearest_the_last_anchor():
    line = (5, 6, 7, 8)
    prediction = line + (1, 2) + line + (3, 4) + line + (9, 9)
    d = PredictionDrafter(PredictionConfig(min_match_len=2))
    d.expect("r", len(PROMPT), prediction)
    answer = line + (1, 2) + line + (3, 4)
    assert tokens(chain(d, answer)[0])[:4] == list(line)  # the anchor follows along
    answer += (0,) + line  # an edit, then the repeated line: which copy is it?
    assert tokens(chain(d, answer)[0])[:2] == [9, 9]  # the copy after the last anchor


def test_prefixes_that_follow_the_prediction_extend_its_chain_and_others_search():
    d = make(max_spec_tokens=8)
    follow, leave = chain(d, PREDICTION[:10], prefixes=(PREDICTION[10:12], (999,)))
    assert tokens(follow) == list(PREDICTION[12:18])  # a path of 8 at most, the prefix included
    assert leave == [[]]


def test_one_level_answers_and_whole_proposals_agree_with_the_chains():
    d = make(max_spec_tokens=6)
    answer = PREDICTION[:8]
    level = d.continue_drafts([ContinueQuery("r", PROMPT + answer, ((),), 1)])[0][0]
    assert level == chain(d, answer)[0][0]
    proposal = d.propose([DraftInput("r", PROMPT + answer, 4)])[0]
    assert proposal.paths == [list(PREDICTION[8:12])] and proposal.drafter == "prediction"


def test_requests_without_a_prediction_or_released_get_nothing():
    d = make()
    assert chain(d, PREDICTION[:5], rid="other") == [[[]]]
    d.release("r")
    assert chain(d, PREDICTION[:5]) == [[[]]] and d.num_tracked_requests == 0


def test_speaks_the_drafter_protocol():
    """Every answer is one the engine's validators keep: a chain that stops before its depth
    ends with an empty level, also where the drafter has nothing at all."""
    d = PredictionDrafter()
    contexts = [PROMPT + PREDICTION[:k] for k in (0, 3, 30)] + [PROMPT + (7, 8, 9)]
    for i, c in enumerate(contexts):
        for prefix in ("p", "c"):
            d.expect(f"{prefix}{i}", len(PROMPT), PREDICTION)
    assert assert_speaks_drafter_protocol(d, contexts, vocab_size=1000) > 0


def test_its_chains_are_what_it_answers_level_by_level():
    d = make(max_spec_tokens=12)
    for answer in (PREDICTION[:4], PREDICTION[:10] + (7, 8), PREDICTION[:10] + (7,) + PREDICTION[12:15], ()):
        q = [ContinueQuery("r", PROMPT + answer, ((), (PREDICTION[len(answer) % 60],), (999,)), 1, depth=20)]
        assert d.continue_chains(q) == continue_chains(d, q)


def test_a_prediction_repeating_one_pair_is_searched_among_the_nearest_anchors_only():
    d = PredictionDrafter(PredictionConfig(max_candidates=8))
    d.expect("r", len(PROMPT), (1, 2) * 5000 + (3,))
    assert tokens(chain(d, (1, 2) * 10 + (5, 1, 2), depth=4)[0]) == [1, 2, 1, 2]  # near the last anchor
