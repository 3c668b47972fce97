"""FrozenLake: transition law equal to Gymnasium FrozenLake-v1's ``P`` on the same maps, empirical
1/3-1/3-1/3 slip frequencies, generated maps always have a path, shortest-path demonstrations."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from ragen_tasks.envs import make
from ragen_tasks.envs.frozen_lake import (
    ACTIONS,
    FrozenLakeEnv,
    generate_map,
    shortest_path,
    transition_table,
    turn_planner,
)

GYM_4X4 = ["SFFF", "FHFH", "FFFH", "HFFG"]


def _gym_law(desc: list[str], **kwargs: float | bool) -> dict[tuple[int, int], dict[int, float]]:
    gym_env = GymFrozenLake(desc=desc, **kwargs)
    law: dict[tuple[int, int], dict[int, float]] = {}
    for s, per_action in gym_env.P.items():
        if desc[s // len(desc[0])][s % len(desc[0])] in "GH":
            continue  # terminal in both: Gymnasium loops in place, ours ends the episode
        for a, entries in per_action.items():
            dist: dict[int, float] = defaultdict(float)
            for p, nxt, _, _ in entries:
                dist[nxt] += p
            law[(s, a)] = dict(dist)
    return law


def _our_law(desc: list[str], **kwargs: float | bool) -> dict[tuple[int, int], dict[int, float]]:
    law: dict[tuple[int, int], dict[int, float]] = {}
    for s, per_action in enumerate(transition_table(desc, **kwargs)):  # type: ignore[arg-type]
        for a, entries in enumerate(per_action):
            if entries:
                dist: dict[int, float] = defaultdict(float)
                for p, nxt in entries:
                    dist[nxt] += p
                law[(s, a)] = dict(dist)
    return law


@pytest.mark.parametrize(
    "desc",
    [GYM_4X4, generate_random_map(size=5, seed=3), generate_random_map(size=8, seed=1), ["SFH", "FFG"]],
)
@pytest.mark.parametrize("kwargs", [{}, {"is_slippery": False}, {"success_rate": 0.6}])
def test_transition_law_equals_gymnasium(desc: list[str], kwargs: dict[str, float | bool]) -> None:
    ours, theirs = _our_law(desc, **kwargs), _gym_law(desc, **kwargs)
    assert ours.keys() == theirs.keys()
    for key, dist in theirs.items():
        assert ours[key].keys() == dist.keys(), key
        for nxt, p in dist.items():
            assert ours[key][nxt] == pytest.approx(p), (key, nxt)


def test_env_steps_follow_the_table_it_was_built_from() -> None:
    """The env's sampled next cells agree with Gymnasium's law on a fixed map (intended 1/3, each side 1/3)."""
    desc = ["FFF", "FSF", "FFG"]  # from the centre every direction lands on a distinct, non-terminal cell
    env = make("frozen_lake", desc=desc)
    assert isinstance(env, FrozenLakeEnv)
    law = _gym_law(desc)
    n = 6000
    for a, name in enumerate(ACTIONS):
        counts: dict[int, int] = defaultdict(int)
        for seed in range(n):
            env.reset(seed=seed * 4 + a)
            env.step(name)
            r, c = env.position
            counts[r * 3 + c] += 1
        expected = law[(4, a)]
        assert counts.keys() == expected.keys()
        for cell, p in expected.items():
            assert p == pytest.approx(1 / 3)
            tolerance = 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma: a false alarm is ~1e-6
            assert abs(counts[cell] / n - p) < tolerance, (name, cell, counts[cell] / n)


def _has_path(desc: tuple[str, ...]) -> bool:
    """Independent flood fill (4-neighbours, no holes) from S to G."""
    cells = {(r, c): ch for r, row in enumerate(desc) for c, ch in enumerate(row)}
    start = next(k for k, v in cells.items() if v == "S")
    seen, stack = {start}, [start]
    while stack:
        r, c = stack.pop()
        if cells[(r, c)] == "G":
            return True
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if nxt in cells and nxt not in seen and cells[nxt] != "H":
                seen.add(nxt)
                stack.append(nxt)
    return False


def test_every_generated_map_has_a_path_and_random_start_goal() -> None:
    starts, goals = set(), set()
    for seed in range(300):
        rng = np.random.default_rng(seed)
        desc = generate_map(rng, 4, 0.8, tries=1000)
        assert _has_path(desc) and sum(row.count("S") for row in desc) == 1
        starts.add("".join(desc).index("S"))
        goals.add("".join(desc).index("G"))
        low = generate_map(rng, 5, 0.5, tries=10_000)
        assert _has_path(low)
    assert len(starts) > 8 and len(goals) > 8


def test_generation_gives_up_with_a_clear_error() -> None:
    env = make("frozen_lake", size=6, p_frozen=0.01, generation_tries=3)
    with pytest.raises(RuntimeError, match=r"in 3 tries at p_frozen=0\.01; raise p_frozen"):
        env.reset(seed=0)


def test_render_symbols_and_episode_end() -> None:
    env = make("frozen_lake", desc=["SH", "FG"], is_slippery=False)
    obs, _ = env.reset(seed=0)
    assert obs == "PO\n_G"
    obs, reward, terminated, _, info = env.step("right")
    assert obs == "_X\n_G" and reward == 0.0 and terminated and not info["success"]
    env.reset(seed=0)
    env.step("Down")
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs == "_O\n_√" and reward == 1.0 and terminated and info["success"] and not truncated
    assert env.legend["√"] == "player on the goal"


def test_shortest_path_demonstrations_reach_the_goal_without_slip() -> None:
    assert (
        shortest_path(GYM_4X4) == ["Down", "Down", "Right", "Down", "Right", "Right"]
        or len(shortest_path(GYM_4X4) or []) == 6
    )
    assert shortest_path(["SH", "HG"]) is None
    assert shortest_path(["FF", "FF"], start=(0, 0), goal=(1, 1)) in (["Down", "Right"], ["Right", "Down"])
    env = make("frozen_lake", is_slippery=False, max_actions_per_episode=100)
    for seed in range(50):
        env.reset(seed=seed)
        plan = shortest_path(env.desc)
        assert plan
        for action in plan:
            *_, info = env.step(action)
        assert info["success"]


def test_truncation_after_max_actions() -> None:
    env = make("frozen_lake", desc=["SFFFFFFF", "FFFFFFFG"], is_slippery=False, max_actions_per_episode=2)
    env.reset(seed=0)
    assert env.step("Left")[3] is False  # into the edge: valid, counted, not effective
    assert env.step("Up")[3] is True
    assert env.step("Right")[1:4] == (0.0, False, True)  # nothing moves after the limit


def test_position_hint_coordinates_adds_the_rows_and_columns_under_the_board() -> None:
    env = FrozenLakeEnv(desc=["FFG", "SFH"], is_slippery=False, position_hint="coordinates")
    board, _ = env.reset(seed=0)
    assert board == "__G\nP_O\nYou are at row 2, column 1. The goal is at row 1, column 3."
    assert env.goal == (0, 2)
    board, *_ = env.step("Right")
    assert board.endswith("You are at row 2, column 2. The goal is at row 1, column 3.")
    plain, _ = FrozenLakeEnv(desc=["FFG", "SFH"]).reset(seed=0)
    assert plain == "__G\nP_O"  # off by default: the board alone


def test_position_hint_directions_names_the_actions_toward_the_goal() -> None:
    env = FrozenLakeEnv(desc=["FFG", "SFH"], is_slippery=False, position_hint="directions")
    board, _ = env.reset(seed=0)
    assert board == "__G\nP_O\nThe goal is Up 1 and Right 2 from you."
    assert env.step("Up")[0].endswith("\nThe goal is Right 2 from you.")  # a zero offset is left out
    assert env.step("Right")[0].endswith("\nThe goal is Right 1 from you.")
    board, reward, terminated, *_ = env.step("Right")
    assert (board, reward, terminated) == ("__√\n__O\nYou are on the goal.", 1.0, True)
    lake = FrozenLakeEnv(desc=["SF", "HG"], position_hint="directions")
    assert lake.reset(seed=0)[0].endswith("The goal is Down 1 and Right 1 from you.")


def test_position_hint_rejects_an_unknown_kind_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"position_hint.*'none', 'coordinates' or 'directions'"):
        FrozenLakeEnv(position_hint="compass")


def _play_planner(desc: list[str], seed: int, episodes: int, per_turn: int) -> float:
    """Success rate of the planner's turns played through the real env (blind within a turn)."""
    env = make("frozen_lake", desc=desc, max_actions_per_episode=10)
    planner = turn_planner(desc, turns=5, actions=10, max_actions_per_turn=per_turn)
    wins = 0
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        done, used = False, 0
        for turns_left in range(5, 0, -1):
            for action in planner.best(env.cell, turns_left, 10 - used):
                *_, terminated, truncated, info = env.step(action)
                used += 1
                if terminated or truncated:
                    done = True
                    break
            if done:
                break
        wins += bool(info["success"])
    return wins / episodes


@pytest.mark.parametrize("per_turn", [1, 3])
def test_turn_planner_value_is_what_its_play_achieves_in_the_env(per_turn: int) -> None:
    planner = turn_planner(GYM_4X4, turns=5, actions=10, max_actions_per_turn=per_turn)
    expected = float(planner.value[5, 10, 0])
    episodes = 4000
    observed = _play_planner(GYM_4X4, seed=7, episodes=episodes, per_turn=per_turn)
    se = math.sqrt(expected * (1 - expected) / episodes)
    assert abs(observed - expected) <= 4 * se, (observed, expected)


def test_turn_planner_without_slip_succeeds_exactly_when_the_path_fits_the_budget() -> None:
    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]  # shortest path: 6 actions
    for turns, per_turn, reachable in [(5, 1, False), (3, 2, True), (2, 3, True), (2, 2, False)]:
        planner = turn_planner(desc, turns=turns, actions=10, max_actions_per_turn=per_turn, is_slippery=False)
        assert planner.value[turns, 10, 0] == (1.0 if reachable else 0.0), (turns, per_turn)
    planner = turn_planner(desc, turns=3, actions=10, max_actions_per_turn=2, is_slippery=False)
    env = make("frozen_lake", desc=desc, is_slippery=False)
    env.reset(seed=0)
    for turns_left in (3, 2, 1):
        row, col = env.position
        for action in planner.best(row * 4 + col, turns_left, 10):
            *_, info = env.step(action)
    assert info["success"]
    assert planner.best(0, 0, 10) == () and planner.best(0, 3, 0) == ()
    # among equally sure plays, the fewest turns: the shortest path, 3 actions a turn
    planner = turn_planner(desc, turns=5, actions=10, max_actions_per_turn=3, is_slippery=False)
    assert planner.best(0, 5, 10) == tuple((shortest_path(desc) or [])[:3])


def test_turn_planner_slip_aware_play_beats_the_shortest_path() -> None:
    """On random 4x4 maps, the planner's value beats replanning the slip-blind shortest path."""
    env = make("frozen_lake", max_actions_per_episode=10)
    values, wins, episodes = [], 0, 0
    for map_seed in range(60):
        env.reset(seed=map_seed)
        desc, start = env.desc, env.position
        values.append(
            turn_planner(desc, turns=5, actions=10, max_actions_per_turn=3).value[5, 10, start[0] * 4 + start[1]]
        )
        for episode in range(40):
            env.reset(seed=map_seed)  # the same map and start; the slip is drawn from the env's stream
            env.np_random = np.random.default_rng(episode)
            for _turn in range(5):
                plan = shortest_path(desc, env.position, env.goal) or ["Left"]
                for action in plan[:3]:
                    *_, terminated, truncated, info = env.step(action)
                    if terminated or truncated:
                        break
                if terminated or truncated:
                    break
            wins += bool(info["success"])
            episodes += 1
    assert float(np.mean(values)) > wins / episodes + 0.08, (float(np.mean(values)), wins / episodes)


def test_turn_planner_rejects_a_budget_it_cannot_search() -> None:
    with pytest.raises(ValueError, match="max_actions_per_turn=7"):
        turn_planner(GYM_4X4, turns=5, actions=10, max_actions_per_turn=7)


def test_cell_is_the_flat_index_of_the_position_on_a_wide_map() -> None:
    """``cell`` indexes the planner's tables: ``row * width + col``, with the map's width, not its height."""
    env = make("frozen_lake", desc=["FFFG", "FSFH"], is_slippery=False)
    env.reset(seed=0)
    assert env.position == (1, 1) and env.cell == 5
    env.step("Up")
    assert env.position == (0, 1) and env.cell == 1
