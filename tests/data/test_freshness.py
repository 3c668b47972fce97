"""Freshness: property tests over versions / staleness bounds, and the rejected-vs-accepted report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ragen_tasks.data.freshness import check_freshness, freshness_report

_spec = importlib.util.spec_from_file_location("_data_factory", Path(__file__).with_name("_factory.py"))
assert _spec is not None and _spec.loader is not None
factory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(factory)

versions = st.integers(0, 1000)


def fp(v: int) -> str:
    return f"{v:064x}"


@given(versions, versions, st.integers(0, 50))
def test_accept_iff_within_bound_and_known(batch: int, current: int, max_staleness: int) -> None:
    known = {v: fp(v) for v in range(current + 1)}
    d = check_freshness(batch, fp(batch), current, known, max_staleness)
    assert d.lag == current - batch
    assert d.accepted == (0 <= current - batch <= max_staleness)
    if batch > current:
        assert d.reason == "future"
    elif current - batch > max_staleness:
        assert d.reason == "stale"
    else:
        assert d.reason == "ok"


@given(versions, st.integers(0, 20), st.integers(0, 20), st.text(min_size=1, max_size=8))
def test_wrong_or_unknown_fingerprint_rejected(current: int, lag: int, max_staleness: int, junk: str) -> None:
    batch = max(0, current - lag)
    known = {v: fp(v) for v in range(current + 1)}
    d = check_freshness(batch, fp(batch) + junk, current, known, max_staleness)
    assert not d.accepted and d.reason in ("stale", "unknown_fingerprint")
    if current - batch <= max_staleness:
        assert d.reason == "unknown_fingerprint"
    unknown = check_freshness(batch, fp(batch), current, {}, max_staleness)  # version never published
    assert not unknown.accepted


@given(versions, st.integers(0, 30))
def test_monotone_in_max_staleness(current: int, max_staleness: int) -> None:
    """If a batch is accepted under a bound, it is accepted under every looser bound."""
    known = {v: fp(v) for v in range(current + 1)}
    for batch in range(max(0, current - 40), current + 1):
        if check_freshness(batch, fp(batch), current, known, max_staleness).accepted:
            assert check_freshness(batch, fp(batch), current, known, max_staleness + 1).accepted


def test_strictly_on_policy() -> None:
    known = {4: fp(4), 5: fp(5)}
    assert check_freshness(5, fp(5), 5, known, 0).accepted
    assert check_freshness(4, fp(4), 5, known, 0).reason == "stale"
    assert check_freshness(6, fp(6), 5, known, 3).reason == "future"


@pytest.mark.parametrize("bad", [(-1, 0, 0), (0, -1, 0), (0, 0, -1), (True, 0, 0)])
def test_bad_inputs_named(bad: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be an int >= 0"):
        check_freshness(bad[0], "x", bad[1], {}, bad[2])


def test_report_counts_and_length_bias() -> None:
    known = {5: fp(5), 4: fp(4)}
    fresh = [factory.make_trajectory(i, tokens=30, turns=1, policy_version=5, fingerprint=fp(5)) for i in range(6)]
    stale = [factory.make_trajectory(i, tokens=90, turns=3, policy_version=2, fingerprint=fp(2)) for i in range(3)]
    future = [factory.make_trajectory(0, tokens=50, turns=2, policy_version=7, fingerprint=fp(7))]
    wrong = [factory.make_trajectory(1, tokens=50, turns=2, policy_version=4, fingerprint="bad")]
    report = freshness_report(
        fresh + stale + future + wrong, current_version=5, known_fingerprints=known, max_staleness=1
    )
    assert report.counts == {"ok": 6, "stale": 3, "future": 1, "unknown_fingerprint": 1}
    assert report.accepted == fresh and len(report.rejected) == 5
    assert report.accepted_lengths.tokens_mean == 30 and report.accepted_lengths.turns_histogram == {1: 6}
    assert report.rejected_lengths.turns_histogram == {2: 2, 3: 3}
    assert report.rejected_lengths.tokens_mean == pytest.approx((3 * 90 + 2 * 50) / 5)
    m = report.metrics()
    assert m["freshness/stale"] == 3 and m["freshness/rejected_fraction"] == pytest.approx(5 / 11)
