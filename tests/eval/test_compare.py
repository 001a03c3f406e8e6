"""The comparison core of `stoker eval`, on hand-made token ids and logprobs (no sockets)."""

from __future__ import annotations

import pytest

from stoker.tools.eval.compare import (
    Output,
    Step,
    Tolerances,
    compare_outputs,
    compare_tokenization,
    first_difference,
    odd_ones_out,
    truncate_at_stop,
    verdict,
)

TOL = Tolerances(logprob_atol=0.01, tie_margin=0.05)


def out(ids, lps=None, finish="length", tops=None, text=""):
    lps = lps or [-1.0] * len(ids)
    tops = tops or [{}] * len(ids)
    return Output([Step(t, lp, top) for t, lp, top in zip(ids, lps, tops)], finish, text)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_tokenization_match_and_doubled_bos():
    same = compare_tokenization([1, 5, 6], [1, 5, 6], bos_id=1)
    assert same.match and not same.doubled_bos
    doubled = compare_tokenization([1, 1, 5, 6], [1, 5, 6], bos_id=1)
    assert not doubled.match and doubled.first_diff == 1 and doubled.doubled_bos
    v = verdict("p", "prompt", doubled, None, TOL)
    assert not v.passed
    assert any("doubled BOS" in f for f in v.failures)
    assert any("tokenization differs at id 1" in f for f in v.failures)


def test_agreeing_outputs_pass_and_report_the_largest_logprob_gap():
    check = compare_outputs(
        out([4, 5, 6], [-1.0, -2.0, -3.0]), out([4, 5, 6], [-1.0, -2.004, -3.001]), TOL
    )
    assert check.ids_agree and check.first_divergence is None and check.compared == 3
    assert check.max_abs_dlogprob == pytest.approx(0.004)
    assert verdict("p", "prompt", None, check, TOL).passed


def test_logprob_drift_beyond_tolerance_fails():
    check = compare_outputs(out([4, 5], [-1.0, -2.0]), out([4, 5], [-1.0, -2.5]), TOL)
    assert check.ids_agree
    v = verdict("p", "prompt", None, check, TOL)
    assert not v.passed and "max |Δ logprob| 0.5" in v.failures[0]


def test_divergence_on_a_near_tie_is_a_note_not_a_failure():
    # At step 1 the reference chose 5 (-0.70) over 9 (-0.72): the server's 9 is a coin flip.
    server = out([4, 9, 9], [-1.0, -0.71, -1.0])
    ref = out([4, 5, 5], [-1.0, -0.70, -1.0], tops=[{4: -1.0}, {5: -0.70, 9: -0.72}, {}])
    check = compare_outputs(server, ref, TOL)
    assert check.first_divergence == 1 and check.compared == 1
    assert check.near_tie and check.tie_gap == pytest.approx(0.02)
    v = verdict("p", "prompt", None, check, TOL)
    assert v.passed and "near tie" in v.warnings[0]


def test_clear_divergence_fails_and_says_where():
    server = out([4, 7])
    ref = out([4, 5], [-1.0, -0.1], tops=[{}, {5: -0.1, 7: -3.0}])
    check = compare_outputs(server, ref, TOL)
    assert check.first_divergence == 1 and not check.near_tie
    assert check.tie_gap == pytest.approx(2.9)
    v = verdict("p", "prompt", None, check, TOL)
    assert not v.passed and "diverge at output token 1" in v.failures[0]


def test_a_trailing_eos_is_compared_by_finish_reason_not_as_a_token():
    eos = frozenset({2})
    listed = out([4, 5, 2], finish="stop")  # one engine lists the EOS among its tokens
    unlisted = out([4, 5], finish="stop")  # the other does not
    check = compare_outputs(listed, unlisted, TOL, eos)
    assert check.ids_agree and verdict("p", "prompt", None, check, TOL).passed


def test_running_past_eos_fails():
    eos = frozenset({2})
    ignored = out([4, 5, 2, 8], finish="length")  # the server did not stop at the EOS
    ref = out([4, 5, 2], finish="stop")
    check = compare_outputs(ignored, ref, TOL, eos)
    assert check.first_divergence == 2
    assert not verdict("p", "prompt", None, check, TOL).passed


def test_same_ids_different_finish_fails():
    check = compare_outputs(out([4, 5], finish="length"), out([4, 5], finish="stop"), TOL)
    v = verdict("p", "prompt", None, check, TOL)
    assert not v.passed and "finish_reason" in v.failures[0]


def test_stop_strings():
    assert truncate_at_stop(["a", "ab", "ab,c", "ab,cd"], [","]) == (3, "ab")
    assert truncate_at_stop(["a", "ab"], [","]) is None
    assert truncate_at_stop(["xy", "xyz"], ["z", "y"]) == (1, "x")  # the earliest stop wins
    check = compare_outputs(out([4, 5], finish="stop"), out([4, 5], finish="stop"), TOL)
    assert verdict("p", "prompt", None, check, TOL, stop_text=("ab", "ab")).passed
    v = verdict("p", "prompt", None, check, TOL, stop_text=("ab,", "ab"))
    assert not v.passed and "stop string" in v.failures[0]


def test_usage_must_count_what_tokenize_says():
    tk = compare_tokenization([1, 5, 6], [1, 5, 6], bos_id=1)
    assert verdict("p", "prompt", tk, None, TOL, usage_prompt_tokens=3).passed
    v = verdict("p", "prompt", tk, None, TOL, usage_prompt_tokens=4)
    assert not v.passed and "usage.prompt_tokens 4" in v.failures[0]


def test_odd_ones_out():
    # Replica 2 disagrees with 0 and 1, which agree: only it is named.
    m = [[False, False, True], [False, False, True], [True, True, False]]
    assert odd_ones_out(m) == [2]
    assert odd_ones_out([[False, True], [True, False]]) == [0, 1]  # two: neither is trusted
    assert odd_ones_out([[False, False], [False, False]]) == []
