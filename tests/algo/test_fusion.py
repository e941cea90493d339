"""Confidence fusion (eq. 4), round by round, against hand-worked cases."""

import pytest

from cosine_ray.algo.fusion import FusionState


def test_fused_token_is_the_most_confident_and_losers_stay_as_branches():
    s = FusionState(("a", "b"), max_depth=3)
    assert s.queries() == {"a": ((),), "b": ((),)}
    s.absorb({"a": [[(10, 0.6)]], "b": [[(20, 0.9)]]})
    assert s.trunk == [20] and s.trunk_owners == ["b"]
    assert [p.token_ids for p in s.branches] == [(10,)]
    # round 1: a is asked to continue the fused prefix and its own losing token
    assert s.queries() == {"a": ((20,), (10,)), "b": ((20,),)}
    s.absorb({"a": [[(11, 0.5)], [(12, 0.7)]], "b": [[(21, 0.8)]]})
    assert s.trunk == [20, 21]
    paths = {p.token_ids: p for p in s.paths()}
    assert set(paths) == {(20, 21), (10,), (10, 12), (20, 11)}
    assert paths[(10, 12)].owners == ("a", "a") and paths[(10, 12)].confidences == (0.6, 0.7)
    assert paths[(20, 11)].confidences == (0.9, 0.5)
    assert s.answers == {"a": [(10, 0.6), (11, 0.5)], "b": [(20, 0.9), (21, 0.8)]}
    assert s.fusion_picks() == {"b": 2}


def test_agreeing_drafters_make_no_branch_and_ties_go_to_the_first_listed():
    s = FusionState(("a", "b"), max_depth=2)
    s.absorb({"a": [[(5, 0.7)]], "b": [[(5, 0.7)]]})
    assert s.trunk_owners == ["a"] and s.branches == []
    assert s.queries() == {"a": ((5,),), "b": ((5,),)}


def test_stops_at_depth_when_nobody_answers_and_below_the_cut():
    s = FusionState(("a",), max_depth=2)
    s.absorb({"a": [[(1, 0.9)]]})
    s.absorb({"a": [[(2, 0.9)]]})
    assert s.done and s.trunk == [1, 2] and s.queries() == {}
    s = FusionState(("a", "b"), max_depth=8)
    s.absorb({"a": [[]], "b": []})
    assert s.done and s.paths() == []
    s = FusionState(("a", "b"), max_depth=8, min_cumulative=0.3)
    s.absorb({"a": [[(1, 0.5)]], "b": [[(2, 0.2)]]})  # b's branch 0.2 < 0.3: dropped, not continued
    assert not s.done and s.branches == [] and s.queries() == {"a": ((1,),), "b": ((1,),)}
    s.absorb({"a": [[(3, 0.5)]]})  # trunk cumulative 0.25 < 0.3
    assert s.done


def test_calibration_decides_the_argmax_but_routing_sees_raw_confidences():
    def calibrate(drafter, c, depth, is_trunk):  # "a" is overconfident; a losing token counts half
        assert depth == 1
        return c * (0.1 if drafter == "a" else 1.0) * (1.0 if is_trunk else 0.5)

    s = FusionState(("a", "b"), max_depth=1, calibrate=calibrate)
    s.absorb({"a": [[(1, 0.9)]], "b": [[(2, 0.5)]]})
    assert s.trunk == [2] and s.trunk_confidences == [0.5]
    assert s.answers["a"] == [(1, 0.9)]
    branch = s.branches[0]  # the loser is kept as a branch, valued as one
    assert branch.confidences == pytest.approx((0.045,)) and branch.raw_confidences == (0.9,)
    assert branch.trunk_flags == (False,) and s.paths()[0].trunk_flags == ()


def test_a_failed_drafter_has_no_token_that_round():
    s = FusionState(("a", "b"), max_depth=3)
    s.absorb({"b": [[(7, 0.4)]]})
    assert s.trunk == [7] and s.answers["a"] == [(None, 0.0)]
