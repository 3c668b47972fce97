"""Regression gate statistics and evaluation aggregation."""

from __future__ import annotations

import random

import pytest

from ragen_tasks.evaluation import binomial_tail, check_record, pair_outcomes, regression_gate


def _outcomes(successes: list[bool], offset: int = 0) -> list[dict[str, object]]:
    return [{"seed": offset + i, "success": ok, "reward": float(ok)} for i, ok in enumerate(successes)]


def _flip(successes: list[bool], losses: int, gains: int) -> list[bool]:
    """``successes`` with the first ``losses`` successes and the first ``gains`` failures flipped."""
    out, lost, won = list(successes), 0, 0
    for i, ok in enumerate(successes):
        if ok and lost < losses:
            out[i], lost = False, lost + 1
        elif not ok and won < gains:
            out[i], won = True, won + 1
    return out


BASE = [i % 3 != 0 for i in range(64)]  # 42 of 64 seeds solved


def test_identical_results_pass() -> None:
    base = {"bandit": _outcomes(BASE), "frozen_lake": _outcomes([i % 5 == 0 for i in range(64)])}
    result = regression_gate(base, base)
    assert result.passed and all(v.losses == v.gains == 0 and v.p_value == 1.0 for v in result.verdicts)


def test_a_real_drop_fails_and_names_the_env() -> None:
    base = {"bandit": _outcomes(BASE), "frozen_lake": _outcomes(BASE)}
    cur = {"bandit": _outcomes(_flip(BASE, losses=12, gains=1)), "frozen_lake": _outcomes(BASE)}
    result = regression_gate(cur, base)
    assert not result.passed
    assert [v.env_name for v in result.verdicts if v.regressed] == ["bandit"]
    assert "REGRESSED" in result.summary() and "bandit" in result.summary()


def test_pairing_sees_a_drop_that_two_independent_proportions_miss() -> None:
    # 8 seeds lost, none won, out of 64: 42/64 -> 34/64. Two independent proportions: z = 1.43,
    # p = 0.08, not significant at 0.01. Paired: all 8 discordant seeds go one way, p = 2**-8.
    result = regression_gate({"e": _outcomes(_flip(BASE, 8, 0))}, {"e": _outcomes(BASE)})
    (verdict,) = result.verdicts
    assert (verdict.losses, verdict.gains) == (8, 0)
    assert verdict.p_value == pytest.approx(2**-8) and verdict.regressed


def test_improvement_passes() -> None:
    assert regression_gate({"b": _outcomes([True] * 64)}, {"b": _outcomes(BASE)}).passed


def test_sampling_noise_passes_at_the_stated_level() -> None:
    # Two evaluations of the SAME policy (true success 0.5 per seed, independent draws) on the same
    # seeds: the gate must not fire more often than alpha (0.01) plus slack, over many simulated pairs.
    rng = random.Random(0)
    fired = 0
    trials = 400
    for _ in range(trials):
        a = [rng.random() < 0.5 for _ in range(64)]
        b = [rng.random() < 0.5 for _ in range(64)]
        fired += not regression_gate({"e": _outcomes(b)}, {"e": _outcomes(a)}).passed
    assert fired / trials < 0.02


def test_small_drop_below_tolerance_passes_even_with_huge_n() -> None:
    base = [i % 2 == 0 for i in range(10_000)]
    assert regression_gate({"e": _outcomes(_flip(base, 200, 0))}, {"e": _outcomes(base)}, min_drop=0.05).passed


def test_only_shared_seeds_are_compared() -> None:
    base = _outcomes([True] * 64)
    cur = _outcomes([True] * 32 + [False] * 32, offset=32)  # seeds 32..95: its 32 shared seeds all pass
    (verdict,) = regression_gate({"e": cur}, {"e": base}).verdicts
    assert verdict.seeds == 32 and verdict.current_success == 1.0 and not verdict.regressed
    with pytest.raises(ValueError, match="shares no seed"):
        regression_gate({"e": _outcomes([True], offset=500)}, {"e": base})


def test_missing_env_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="missing envs"):
        regression_gate({"bandit": _outcomes(BASE)}, {"bandit": _outcomes(BASE), "sokoban": _outcomes(BASE)})


def test_binomial_tail_against_hand_computed_cases() -> None:
    assert binomial_tail(0, 0) == 1.0 and binomial_tail(0, 5) == 1.0
    assert binomial_tail(3, 3) == pytest.approx(1 / 8)
    assert binomial_tail(2, 3) == pytest.approx(4 / 8)  # P(2) + P(3) = (3 + 1) / 8
    assert binomial_tail(9, 10) == pytest.approx(11 / 1024)


def test_a_baseline_without_per_seed_outcomes_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="ragen evaluate CHECKPOINT --json"):
        check_record({"bandit": {"success": 0.5, "episodes": 64}}, "baseline 'old.json'")


def test_one_sided_z_against_a_hand_computed_case() -> None:
    from ragen_tasks.evaluation import one_sided_z

    # 0.5 vs 0.6 on 100 each: pooled 0.55, se = sqrt(0.55 * 0.45 * 0.02) = 0.070356
    assert one_sided_z(0.5, 100, 0.6, 100) == pytest.approx(0.1 / 0.0703562, rel=1e-5)
    assert one_sided_z(0.6, 100, 0.5, 100) == pytest.approx(-0.1 / 0.0703562, rel=1e-5)
    assert one_sided_z(0.0, 10, 0.0, 10) == 0.0 and one_sided_z(1.0, 10, 1.0, 10) == 0.0


def test_reference_points_on_fixed_games() -> None:
    from ragen_tasks.config import AgentConfig, EnvSpec
    from ragen_tasks.envs.frozen_lake import turn_planner
    from ragen_tasks.evaluation import reference_points

    room = "\n".join(["######", "#_O__#", "#____#", "#_X_P#", "#____#", "######"])  # solved in 5 actions
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)
    sokoban = reference_points(EnvSpec(name="sokoban", config={"room": room}), agent, seeds=4, seed_offset=0)
    assert sokoban["ceiling"] == 1.0 and 0.0 <= sokoban["random"] < 0.5
    short = AgentConfig(max_turns=2, max_actions_per_turn=2, max_actions_per_episode=10)  # 4 actions at most
    assert (
        reference_points(EnvSpec(name="sokoban", config={"room": room}), short, seeds=2, seed_offset=0)["ceiling"]
        == 0.0
    )

    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]
    lake = reference_points(EnvSpec(name="frozen_lake", config={"desc": desc}), agent, seeds=3, seed_offset=7)
    planner = turn_planner(desc, turns=5, actions=10, max_actions_per_turn=3)
    assert lake["ceiling"] == pytest.approx(float(planner.value[5, 10, 0]))
    again = reference_points(EnvSpec(name="frozen_lake", config={"desc": desc}), agent, seeds=3, seed_offset=7)
    assert again == lake  # seeded: the same seeds give the same random play

    bandit = reference_points(EnvSpec(name="bandit"), AgentConfig(max_turns=1), seeds=200, seed_offset=0)
    assert bandit["ceiling"] == 1.0 and 0.35 < bandit["random"] < 0.65


def test_paired_outcomes_count_the_discordant_shared_seeds() -> None:
    first = _outcomes([True, True, False, False, True])  # seeds 0..4
    second = _outcomes([True, False, True, True, True, True])  # seeds 0..5: seed 5 is not shared
    pair = pair_outcomes(first, second, "e")
    assert (pair.seeds, pair.first_only, pair.second_only) == (5, 1, 2)
    assert (pair.first_success, pair.second_success) == (0.6, 0.8)
    assert pair.p_second_better() == pytest.approx(4 / 8)  # P(Binomial(3, 1/2) >= 2)
    assert pair.p_first_better() == pytest.approx(7 / 8)  # P(Binomial(3, 1/2) >= 1)
    with pytest.raises(ValueError, match="after RL shares no seed with the before RL"):
        pair_outcomes(first, _outcomes([True], offset=50), "e", names=("before RL", "after RL"))
