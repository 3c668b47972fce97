"""Per-turn advantages against the game's optimal values (``algo.advantage=turn_td``): the TD(lambda)
math, the tokens they land on, the replay that values each turn's state, and an update through the
pipeline on real rollouts of the slippery lake."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ragen_tasks import pipeline
from ragen_tasks.algos.advantages import turn_td_advantages
from ragen_tasks.algos.masked import masked_whiten
from ragen_tasks.config import AgentConfig
from ragen_tasks.data.synthetic import trajectory as synthetic_trajectory
from ragen_tasks.data.token_batch import collate, with_turn_advantages
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make
from ragen_tasks.presets import load_config
from ragen_tasks.training.turn_values import optimal_turn_advantages, optimal_turn_values
from tests.conftest import TINY_RUN


def test_turn_td_at_lambda_0_credits_each_turn_with_its_own_td_error_and_at_1_with_its_return_less_its_value() -> None:
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.0, 0.0, 0.0]])  # (B=2, K=3); row 1 has 2 turns
    values = torch.tensor([[0.4, 0.5, 0.9, 0.0], [0.3, 0.1, 0.0, 7.0]])  # (B, K + 1); 7.0 is past row 1's end
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    delta = torch.tensor([[0.1, 0.3, 0.1], [-0.2, -0.1, 0.0]])  # r_k + V_{k+1} - V_k by hand
    assert torch.allclose(turn_td_advantages(rewards, values, valid, lam=0.0), masked_whiten(delta, valid), atol=1e-6)
    returns_less_value = torch.tensor([[0.9 - 0.4, 0.9 - 0.5, 1.0 - 0.9], [-0.3, -0.1, 0.0]])  # sum_{j>=k} r_j - V_k
    assert torch.allclose(
        turn_td_advantages(rewards, values, valid, lam=1.0), masked_whiten(returns_less_value, valid), atol=1e-6
    )
    half = turn_td_advantages(rewards, values, valid, lam=0.5)
    by_hand = torch.tensor([[0.1 + 0.5 * 0.3 + 0.25 * 0.1, 0.3 + 0.5 * 0.1, 0.1], [-0.2 - 0.05, -0.1, 0.0]])
    assert torch.allclose(half, masked_whiten(by_hand, valid), atol=1e-6)
    assert half[1, 2] == 0  # a padding turn has no advantage


def test_turn_td_refuses_values_of_the_wrong_length_and_turns_after_padding() -> None:
    rewards, valid = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"expected \(1, 3\)"):
        turn_td_advantages(rewards, torch.zeros(1, 2), valid, lam=1.0)
    with pytest.raises(ValueError, match="prefix"):
        turn_td_advantages(rewards, torch.zeros(1, 3), torch.tensor([[False, True]]), lam=1.0)


def test_turn_advantages_land_on_the_tokens_sampled_in_their_turn() -> None:
    # prompt 0-1, turn 0 sampled at 2-3, observation 4, turn 1 sampled at 5-6
    trajectory = synthetic_trajectory(
        [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1], [2, 5], [4, 7], [0.0, 1.0], prompt_length=2
    )
    batch = collate([trajectory])
    assert batch.turn_advantages is None  # not given yet
    given = with_turn_advantages(batch, torch.tensor([[0.5, -2.0]]), torch.tensor([[[2, 4], [5, 7]]]))
    assert given.turn_advantages is not None
    assert given.turn_advantages.tolist() == [[0.0, 0.0, 0.5, 0.5, 0.0, -2.0, -2.0]]


def _lake_episode(seed: int, turns: list[list[str]]) -> tuple[list[str], list[list[str]], list[int]]:
    """Play ``turns`` on the paper's lake from ``seed``: (boards before each turn, the actions each
    turn ran, the cell before each turn and after the last)."""
    lake = make("frozen_lake")
    board, _ = lake.reset(seed=seed)
    boards, ran, cells = [], [], [lake.position[0] * 4 + lake.position[1]]
    for actions in turns:
        boards.append(board)
        ran.append([])
        for action in actions:
            board, _, terminated, _, _ = lake.step(action)
            ran[-1].append(action)
            if terminated:
                break
        cells.append(lake.position[0] * 4 + lake.position[1])
        if terminated:
            break
    return boards, ran, cells


def _played(
    env_name: str, seed: int, ran: list[list[str]], boards: list[str], named: list[list[str]] | None = None
) -> Trajectory:
    """A trajectory of those turns (its tokens: a prompt token, then one sampled token a turn); each
    turn's response names ``named`` (default: the actions it ran)."""
    n = len(ran)
    responses = [f"<think>I act.</think><answer>{' || '.join(actions)}</answer>" for actions in (named or ran)]
    return synthetic_trajectory(
        list(range(n + 1)),
        [0] + [1] * n,
        list(range(1, n + 1)),
        list(range(2, n + 2)),
        [0.0] * n,
        prompt_length=1,
        env_name=env_name,
        seed=seed,
        turn_actions=ran,
        turn_observations=boards,
        turn_responses=responses,
    )


def test_optimal_turn_values_replay_the_episode_and_read_the_planners_value_of_each_state() -> None:
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)
    seed = 11
    boards, ran, cells = _lake_episode(seed, [["Down", "Right"], ["Right"], ["Down", "Down", "Right"]])
    trajectory = _played("frozen_lake", seed, ran, boards)
    lake = make("frozen_lake")
    lake.reset(seed=seed)
    planner = lake.planner(turns=5, actions=10, max_actions_per_turn=3)
    values = optimal_turn_values(trajectory, {}, agent)
    assert len(values) == len(ran) + 1
    used = 0
    for turn, cell in enumerate(cells[: len(ran)]):  # before each turn: the planner's value with what is left
        assert values[turn] == pytest.approx(planner.value[5 - turn, 10 - used, cell])
        used += len(ran[turn])
    row, col = divmod(cells[-1], 4)
    over = lake.desc[row][col] in "GH"
    expected_last = 0.0 if over else planner.value[5 - len(ran), 10 - used, cells[-1]]
    assert values[-1] == pytest.approx(expected_last)
    assert 0 < values[0] < 1  # a slippery lake is neither sure nor hopeless from its start


def test_a_replay_that_does_not_reach_the_recorded_board_is_an_error_not_a_wrong_value() -> None:
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)
    boards, ran, _ = _lake_episode(3, [["Down"], ["Right"]])
    trajectory = _played("frozen_lake", 3, ran, boards)
    with pytest.raises(ValueError, match="before turn 0"):
        optimal_turn_values(trajectory, {"is_slippery": False, "size": 5}, agent)  # another game config
    with pytest.raises(ValueError, match="no optimal state value"):
        optimal_turn_values(replace(trajectory, env_name="sokoban"), {}, agent)


def test_a_turns_outcome_is_where_its_actions_land_under_the_slip_law() -> None:
    firm = make("frozen_lake", desc=["SFH", "FFG"], is_slippery=False)
    firm.reset(seed=0)
    assert firm.turn_outcome(["Right", "Down", "Right"]).tolist() == [0, 0, 0, 0, 0, 1]  # walks onto the goal
    assert firm.turn_outcome(["Right", "Right", "Down"]).tolist() == [0, 0, 1, 0, 0, 0]  # the hole ends the turn
    assert firm.turn_outcome([]).tolist() == [1, 0, 0, 0, 0, 0]
    ice = make("frozen_lake", desc=["SFH", "FFG"])
    ice.reset(seed=0)
    one = ice.turn_outcome(["Right"])  # intended Right, or a slip Up (the wall: stays) or Down
    assert one == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3, 0, 0])
    two = ice.turn_outcome(["Right", "Right"])
    assert two.sum() == pytest.approx(1.0) and two[2] > 0  # some of it has fallen in the hole and stays


def test_the_planners_own_turn_has_no_exact_advantage_and_a_worse_one_a_negative_one() -> None:
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)
    for seed in range(20):
        lake = make("frozen_lake")
        lake.reset(seed=seed)
        planner = lake.planner(turns=5, actions=10, max_actions_per_turn=3)
        row, col = lake.position
        best = list(planner.best(row * 4 + col, 5, 10))
        worst = min(
            ([a] for a in ("Left", "Down", "Right", "Up")),
            key=lambda actions: lake.turn_outcome(actions) @ planner.value[4, 9],
        )
        if lake.turn_outcome(worst) @ planner.value[4, 9] < planner.value[5, 10, row * 4 + col] - 0.05:
            break
    boards, ran, _ = _lake_episode(seed, [best])
    assert optimal_turn_advantages(_played("frozen_lake", seed, ran, boards, [best]), {}, agent) == pytest.approx([0])
    boards, ran, _ = _lake_episode(seed, [worst])
    (advantage,) = optimal_turn_advantages(_played("frozen_lake", seed, ran, boards, [worst]), {}, agent)
    assert advantage == pytest.approx(
        lake.turn_outcome(worst) @ planner.value[4, 9] - planner.value[5, 10, row * 4 + col]
    )
    assert advantage < -0.05
    bad = replace(_played("frozen_lake", seed, [[]], boards[:1], [[]]), turn_format_ok=[False])
    (wasted,) = optimal_turn_advantages(bad, {}, agent)  # a turn that named nothing, and its penalty
    assert wasted == pytest.approx(planner.value[4, 10, row * 4 + col] - planner.value[5, 10, row * 4 + col] - 0.1)


def test_turn_q_refuses_a_response_that_does_not_name_what_the_turn_ran() -> None:
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)
    boards, ran, _ = _lake_episode(5, [["Down", "Right"]])
    with pytest.raises(ValueError, match="its response names"):
        optimal_turn_advantages(_played("frozen_lake", 5, ran, boards, [["Up"]]), {}, agent)


def test_turn_td_is_refused_where_an_episode_could_not_be_valued() -> None:
    with pytest.raises(ValueError, match="'sokoban', which has none"):
        load_config("sokoban", {"algo.advantage": "turn_td"})
    two_lakes = [{"name": "frozen_lake"}, {"name": "frozen_lake", "config": {"size": 5}}]
    with pytest.raises(ValueError, match="'frozen_lake' 2 times"):
        load_config("frozenlake", {"algo.advantage": "turn_td", "envs": two_lakes})
    with pytest.raises(ValueError, match="'turn_td' gives observation tokens no advantage"):
        load_config("frozenlake", {"algo.advantage": "turn_td", "agent.loss_on_observations": True})


@pytest.fixture(scope="module")
def lake_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store for both estimators' runs, so the second starts from the first's cached warm start."""
    return tmp_path_factory.mktemp("turn-advantages") / "runs"


@pytest.mark.parametrize("advantage", ["turn_td", "turn_q"])
def test_an_update_with_turn_advantages_values_the_real_rollouts_of_the_slippery_lake(
    lake_runs: Path, advantage: str
) -> None:
    """Through the update stage: rollouts of the paper's lake, played by a model warm-started enough
    to move (100 steps), are replayed and valued (a replay that missed a recorded board would raise),
    and the update trains on the turns' advantages."""
    config = load_config(
        "frozenlake",
        {
            **TINY_RUN,
            "store.root": str(lake_runs),
            "iterations": 1,
            "warm_start.steps": 100,
            "algo.advantage": advantage,
            "algo.lam": 0.5,
            "agent.max_turns": 5,
            "agent.max_tokens_per_turn": 32,
        },
    )
    run = pipeline.open_run(config, advantage)
    pipeline.init_run(run)
    pipeline.generate_tasks(run, 0)
    pipeline.rollout(run, 0)
    trajectories, _ = run.store.read_trajectories(run.run_id, 0, "rollouts")
    moved = [t for t in trajectories if sum(bool(actions) for actions in t.turn_actions) >= 2]
    assert moved, "no rollout moved in two turns: the replay would not be tested"
    pipeline.filter_and_validate(run, 0)
    metrics = pipeline.update(run, 0)
    assert metrics["actor/steps"] >= 1
    assert metrics["batch/zero_adv_rows"] < metrics["batch/trajectories"]  # the turns carried signal
