"""Warm-start demonstrations: what the demonstrator writes in its reasoning."""

import pytest
import torch

from ragen_tasks.envs import make
from ragen_tasks.training.warm_start import demo_reasoning


@pytest.mark.parametrize("hint", ["coordinates", "directions"])
def test_frozen_lake_demonstrator_restates_the_position_hint_under_the_board(hint: str) -> None:
    env = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False, position_hint=hint)
    board, _ = env.reset(seed=0)
    assert board.endswith("\n" + demo_reasoning(env))  # read from the observation, not invented
    board, *_ = env.step("Right")
    assert board.endswith("\n" + demo_reasoning(env))


def test_fixed_reasoning_is_one_sentence_per_game() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"])
    lake.reset(seed=0)
    assert demo_reasoning(lake, "fixed") == "I move toward the goal and stay off the holes."
    bandit = make("bandit")
    bandit.reset(seed=0)
    for style in ("fixed", "relative"):
        assert not any(arm in demo_reasoning(bandit, style) for arm in bandit.action_names)  # arm-neutral


def test_relative_reasoning_reads_the_board() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"])
    lake.reset(seed=0)
    assert demo_reasoning(lake) == "The goal is Up 1 and Right 2 from me."
    room = "\n".join(["######", "#_O__#", "#____#", "#_X_P#", "#____#", "######"])
    sokoban = make("sokoban", room=room)
    sokoban.reset(seed=0)
    assert demo_reasoning(sokoban) == "The box is Left 2 from me. The target is Up 2 from the box."
    sokoban.step("Left")  # the player walks next to the box
    sokoban.step("Left")  # and pushes it one cell left, past the target's column
    assert demo_reasoning(sokoban) == "The box is Left 1 from me. The target is Up 2 and Right 1 from the box."


def test_neighbours_reasoning_names_each_side_of_the_player() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False)
    lake.reset(seed=0)  # S at the bottom left
    assert demo_reasoning(lake, "neighbours") == (
        "The goal is Up 1 and Right 2 from me. Left wall. Down wall. Right frozen. Up frozen."
    )
    lake.step("Right")
    assert demo_reasoning(lake, "neighbours").endswith("Left frozen. Down wall. Right hole. Up frozen.")
    lake.step("Up")
    assert demo_reasoning(lake, "neighbours") == (
        "The goal is Right 1 from me. Left frozen. Down frozen. Right goal. Up wall."
    )
    room = "\n".join(["######", "#_O__#", "#____#", "#_X_P#", "#____#", "######"])
    sokoban = make("sokoban", room=room)
    sokoban.reset(seed=0)
    assert demo_reasoning(sokoban, "neighbours") == (
        "The box is Left 2 from me. The target is Up 2 from the box. Up floor. Down floor. Left floor. Right wall."
    )
    sokoban.step("Left")
    sokoban.step("Left")  # pushes the box one cell left
    assert demo_reasoning(sokoban, "neighbours").endswith("Up floor. Down floor. Left box. Right floor.")


def test_neighbours_turns_reasoning_adds_the_turns_left() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False)
    lake.reset(seed=0)
    assert demo_reasoning(lake, "neighbours-turns", turns_left=3) == (
        "The goal is Up 1 and Right 2 from me. Left wall. Down wall. Right frozen. Up frozen. Turns left: 3."
    )
    with pytest.raises(ValueError, match="turns_left"):
        demo_reasoning(lake, "neighbours-turns")
    bandit = make("bandit")
    bandit.reset(seed=0)
    assert demo_reasoning(bandit, "neighbours-turns") == demo_reasoning(bandit, "fixed")  # no turns on a bandit


def test_neighbours_diagonals_reasoning_names_the_four_diagonal_cells() -> None:
    lake = make("frozen_lake", desc=["HFG", "SFH", "FHF"], is_slippery=False)
    lake.reset(seed=0)  # S at the middle left
    assert demo_reasoning(lake, "neighbours-diagonals") == (
        "The goal is Up 1 and Right 2 from me. Left wall. Down frozen. Right frozen. Up hole. "
        "Up Left wall. Up Right frozen. Down Left wall. Down Right hole."
    )
    lake.step("Right")
    assert demo_reasoning(lake, "neighbours-diagonals-turns", turns_left=4).endswith(
        "Left frozen. Down hole. Right hole. Up frozen. Up Left hole. Up Right goal. Down Left frozen. "
        "Down Right frozen. Turns left: 4."
    )
    with pytest.raises(ValueError, match="turns_left"):
        demo_reasoning(lake, "neighbours-diagonals-turns")
    room = "\n".join(["######", "#____#", "#_X__#", "#__P_#", "#___O#", "######"])
    sokoban = make("sokoban", room=room)
    sokoban.reset(seed=0)
    assert demo_reasoning(sokoban, "neighbours-diagonals").endswith(
        "Up floor. Down floor. Left floor. Right floor. Up Left box. Up Right floor. Down Left floor. Down Right target."
    )
    sokoban.step("Down")
    assert demo_reasoning(sokoban, "neighbours-diagonals").endswith(
        "Up Left floor. Up Right floor. Down Left wall. Down Right wall."
    )


def test_rows_reasoning_copies_the_rows_above_and_below_from_the_board() -> None:
    """The ``rows-`` prefix copies the rendered rows above and below the player (``wall`` past an
    edge) after the relative text, and the rest is the unprefixed style's text."""
    lake = make("frozen_lake", desc=["HFG", "SFH", "FHF"], is_slippery=False)
    board, _ = lake.reset(seed=0)  # S at the middle left
    rows = board.split("\n")[:3]
    assert rows == ["O_G", "P_O", "_O_"]
    style = "rows-neighbours-diagonals-turns"
    plain = demo_reasoning(lake, "neighbours-diagonals-turns", turns_left=4)
    assert demo_reasoning(lake, style, turns_left=4) == plain.replace(
        "from me. ", "from me. Above: O_G. Below: _O_. ", 1
    )
    lake.step("Right")  # the rows copied are the player's, not the start's
    assert "from me. Above: O_G. Below: _O_. Left frozen." in demo_reasoning(lake, style, turns_left=3)
    bottom = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False)
    bottom.reset(seed=0)  # S at the bottom left: nothing below
    assert "from me. Above: __G. Below: wall. Left wall." in demo_reasoning(bottom, style, turns_left=5)
    room = "\n".join(["######", "#____#", "#_X__#", "#__P_#", "#___O#", "######"])
    sokoban = make("sokoban", room=room)
    sokoban.reset(seed=0)
    assert "from the box. Above: #_X__#. Below: #___O#. Up floor." in demo_reasoning(sokoban, style, turns_left=5)


def test_cells_reasoning_copies_the_same_rows_cell_by_cell() -> None:
    """The ``cells-`` prefix is the ``rows-`` text with a space between a row's cells; ``wall`` stays a word."""
    lake = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False)
    lake.reset(seed=0)  # S at the bottom left: nothing below
    rows_text = demo_reasoning(lake, "rows-neighbours-diagonals-turns", turns_left=5)
    cells_text = demo_reasoning(lake, "cells-neighbours-diagonals-turns", turns_left=5)
    assert "Above: __G. Below: wall." in rows_text
    assert cells_text == rows_text.replace("Above: __G.", "Above: _ _ G.")
    room = "\n".join(["######", "#____#", "#_X__#", "#__P_#", "#___O#", "######"])
    sokoban = make("sokoban", room=room)
    sokoban.reset(seed=0)
    assert "Above: # _ X _ _ #. Below: # _ _ _ O #. Up floor." in demo_reasoning(
        sokoban, "cells-neighbours-diagonals-turns", turns_left=5
    )


def test_neighbours_turns_demonstrations_restate_the_prompts_turns_left(chatml_tokenizer) -> None:
    """Each turn's reasoning says the turns left that the prompt before it says, counting down."""
    import re

    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations

    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=AgentConfig(max_turns=5, max_tokens_per_turn=96),
        warm_start=WarmStartConfig(episodes_per_env=16, reasoning="neighbours-turns"),
    )
    demos = demonstrations(chatml_tokenizer, config, seed=0)
    assert any(len(demo.turn_think) > 2 for demo in demos)  # episodes that last, so the count is tested
    for demo in demos:
        prompt = chatml_tokenizer.decode(demo.input_ids)
        said_by_prompt = [int(n) for n in re.findall(r"Turns left: (\d+)\. Actions left", prompt)]
        said_by_reasoning = [int(re.search(r"Turns left: (\d+)\.$", think)[1]) for think in demo.turn_think]
        assert said_by_reasoning == list(range(5, 5 - len(demo.turn_think), -1))
        assert said_by_reasoning == said_by_prompt[: len(said_by_reasoning)]


def test_demo_actions_per_turn_limits_the_demonstrator_not_the_agent(chatml_tokenizer) -> None:
    """With ``warm_start.demo_actions_per_turn=2`` a lake demonstration's turns are the slip-aware
    planner's best plans of at most 2 actions (its first turn checked against a planner built here),
    and the prompt still offers the agent 1 to 3 actions."""
    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.envs import make as make_env
    from ragen_tasks.training.warm_start import demonstrations, lake_planner

    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10, max_tokens_per_turn=64)

    def config(limit: int | None) -> TrainConfig:
        warm = WarmStartConfig(episodes_per_env=32, demo_noise=0.0, demo_actions_per_turn=limit)
        return TrainConfig(envs=[EnvSpec(name="frozen_lake")], agent=agent, warm_start=warm)

    unlimited = demonstrations(chatml_tokenizer, config(None), seed=0)
    limited = demonstrations(chatml_tokenizer, config(2), seed=0)
    assert max(len(a) for demo in unlimited for a in demo.turn_actions) == 3  # the limit changes something
    assert max(len(a) for demo in limited for a in demo.turn_actions) == 2
    two_action_rules = agent.model_copy(update={"max_actions_per_turn": 2})
    for demo in limited:
        assert "Give 1 to 3 actions" in chatml_tokenizer.decode(demo.input_ids[: demo.prompt_length])
        lake = make_env("frozen_lake")
        lake.reset(seed=demo.seed)
        best = list(lake_planner(lake, two_action_rules).best(lake.cell, 5, lake.actions_left))
        first = demo.turn_actions[0]
        assert first == best or (demo.num_turns == 1 and first == best[: len(first)])  # ended midway


def test_demo_actions_per_turn_above_the_agents_limit_is_refused() -> None:
    from ragen_tasks.config import AgentConfig, TrainConfig, WarmStartConfig

    with pytest.raises(
        ValueError, match=r"warm_start.demo_actions_per_turn=4 is more than agent.max_actions_per_turn=3"
    ):
        TrainConfig(agent=AgentConfig(max_actions_per_turn=3), warm_start=WarmStartConfig(demo_actions_per_turn=4))


def test_demonstrations_train_on_their_reasoning_when_rl_does_not(chatml_tokenizer) -> None:
    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations

    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=AgentConfig(max_tokens_per_turn=64, loss_on_reasoning=False),
        warm_start=WarmStartConfig(episodes_per_env=8),
    )
    demos = demonstrations(chatml_tokenizer, config, seed=0)
    assert all(demo.turn_think[0] for demo in demos)  # they do reason ...
    assert all(demo.loss_mask == demo.response_mask for demo in demos)  # ... and all of it is imitated


def test_rl_demonstrations_are_fresh_training_boards_each_iteration(chatml_tokenizer) -> None:
    """RL's supervised term imitates the warm start's demonstrator on boards of its own stream: none
    the warm start trained on, none from the held-out seeds, new ones each iteration, and the same
    ones for the same iteration (every rank builds them alike)."""
    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations, rl_demonstrations

    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=AgentConfig(max_tokens_per_turn=64, loss_on_reasoning=False),
        warm_start=WarmStartConfig(episodes_per_env=64),
    )
    warm = {d.seed for d in demonstrations(chatml_tokenizer, config, seed=config.warm_start.seed_for(config.seed))}
    first = rl_demonstrations(chatml_tokenizer, config, iteration=0, episodes=16)
    again = rl_demonstrations(chatml_tokenizer, config, iteration=0, episodes=16)
    later = rl_demonstrations(chatml_tokenizer, config, iteration=1, episodes=16)
    seeds = [d.seed for d in first]
    assert len(first) == 16 and seeds == [d.seed for d in again]
    assert [d.input_ids for d in first] == [d.input_ids for d in again]
    assert not set(seeds) & warm and not set(seeds) & {d.seed for d in later}
    assert max(seeds + [d.seed for d in later]) < config.eval.seed_offset
    assert all(d.loss_mask == d.response_mask and d.turn_think[0] for d in first)  # the reasoning is imitated


def test_rl_demonstrations_play_at_their_own_noise_when_it_is_set(chatml_tokenizer) -> None:
    """``algo.demo_noise`` replaces the warm start's noise for RL's demonstrations only: with every
    warm-start action random, noise-free RL demonstrations still play the solver's plans."""
    from ragen_tasks.config import AgentConfig, AlgoConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import rl_demonstrations

    def success(algo: AlgoConfig) -> float:
        config = TrainConfig(
            envs=[EnvSpec(name="sokoban")],
            agent=AgentConfig(max_tokens_per_turn=64, max_actions_per_turn=3),
            warm_start=WarmStartConfig(demo_noise=1.0),
            algo=algo,
        )
        demos = rl_demonstrations(chatml_tokenizer, config, iteration=0, episodes=32)
        return sum(d.success for d in demos) / len(demos)

    assert success(AlgoConfig()) < 0.3  # the warm start's noise: random actions
    assert success(AlgoConfig(demo_noise=0.0)) > 0.85  # the BFS solver's plans (0.98 of rooms solvable in 10)


def test_slippery_lake_demonstrations_play_the_turn_planner(chatml_tokenizer) -> None:
    """Noise-free FrozenLake demonstrations on the paper's lake (slippery, random maps) succeed as
    often as the planner's value says, and name at most max_actions_per_turn actions a turn."""
    import math

    import numpy as np

    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.envs.frozen_lake import turn_planner
    from ragen_tasks.training.warm_start import demonstrations

    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10, max_tokens_per_turn=64)
    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=agent,
        warm_start=WarmStartConfig(episodes_per_env=600, demo_noise=0.0),
    )
    demos = demonstrations(chatml_tokenizer, config, seed=0)
    values = []
    for demo in demos:
        lake = make("frozen_lake")
        lake.reset(seed=demo.seed)
        row, col = lake.position
        values.append(turn_planner(lake.desc, turns=5, actions=10, max_actions_per_turn=3).value[5, 10, row * 4 + col])
        assert all(1 <= len(actions) <= 3 for actions in demo.turn_actions[:-1])
    expected, observed = float(np.mean(values)), float(np.mean([d.success for d in demos]))
    assert expected > 0.45  # the paper's lake at this budget (random play ~0.21)
    assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / len(demos)), (observed, expected)


def test_a_demonstration_longer_than_a_turn_is_reported(chatml_tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations

    def config(max_tokens_per_turn: int) -> TrainConfig:
        agent = AgentConfig(max_actions_per_turn=3, max_tokens_per_turn=max_tokens_per_turn)
        warm_start = WarmStartConfig(episodes_per_env=4, reasoning="neighbours")
        return TrainConfig(envs=[EnvSpec(name="frozen_lake")], agent=agent, warm_start=warm_start)

    with caplog.at_level("WARNING", logger="ragen_tasks.training.warm_start"):
        demonstrations(chatml_tokenizer, config(96), seed=0)
        assert not caplog.records
        cut = demonstrations(chatml_tokenizer, config(24), seed=0)
    [record] = caplog.records  # once per warm start, not once per demonstration
    assert "demonstration takes" in record.getMessage()
    assert "agent.max_tokens_per_turn=24: demonstrations are cut" in record.getMessage()
    assert all(end - start <= 24 for demo in cut for start, end in zip(demo.turn_starts, demo.turn_ends, strict=True))


def test_scheduled_lr_decays_linearly_to_zero_over_the_steps() -> None:
    from ragen_tasks.config import scheduled_lr

    assert [scheduled_lr(3e-3, s, 4, "constant") for s in range(4)] == [3e-3] * 4
    assert [scheduled_lr(4e-3, s, 4, "linear") for s in range(4)] == pytest.approx([4e-3, 3e-3, 2e-3, 1e-3])


def test_supervised_steps_step_at_the_scheduled_rate(chatml_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rate each optimizer step of the warm start actually uses (read from AdamW as it steps)."""
    from ragen_tasks.config import EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations, supervised_steps

    rates: list[float] = []
    adamw_step = torch.optim.AdamW.step

    def recording_step(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        rates.append(self.param_groups[0]["lr"])
        return adamw_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    model = _one_layer_model(len(chatml_tokenizer))
    config = TrainConfig(envs=[EnvSpec(name="bandit")], warm_start=WarmStartConfig(episodes_per_env=8))
    demos = demonstrations(chatml_tokenizer, config, seed=0)
    for schedule, expected in (("linear", [4e-3, 3e-3, 2e-3, 1e-3]), ("constant", [4e-3] * 4)):
        rates.clear()
        supervised_steps(model, demos, steps=4, batch_size=4, lr=4e-3, seed=0, pad_id=0, lr_schedule=schedule)
        assert rates == pytest.approx(expected), schedule


def test_turn_segments_cut_each_episode_into_its_turns_with_only_their_own_board(chatml_tokenizer) -> None:
    """A turn segment is the turn's observation and response: one board in context, the turn's
    response trained on, and together the segments train on exactly the episode's response tokens."""
    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training.warm_start import demonstrations, turn_segments

    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=AgentConfig(max_turns=5, max_tokens_per_turn=96),
        warm_start=WarmStartConfig(episodes_per_env=16, reasoning="neighbours-turns"),
    )
    demos = demonstrations(chatml_tokenizer, config, seed=0)
    assert any(demo.num_turns > 2 for demo in demos)  # episodes that last, so later turns are tested
    segments = turn_segments(demos)
    assert len(segments) == sum(demo.num_turns for demo in demos)
    by_episode = iter(segments)
    for demo in demos:
        trained_in_segments: list[int] = []
        for turn in range(demo.num_turns):
            segment = next(by_episode)
            segment.check()
            assert segment.traj_id == f"{demo.traj_id}/turn{turn}"
            assert segment.num_turns == 1
            [start], [end] = segment.turn_starts, segment.turn_ends
            assert end == segment.num_tokens  # the segment ends with its turn's response
            assert segment.input_ids[start:end] == demo.input_ids[demo.turn_starts[turn] : demo.turn_ends[turn]]
            assert segment.turn_think == [demo.turn_think[turn]]
            assert chatml_tokenizer.decode(segment.input_ids[:start]).count("Board:") == 1  # its own board only
            assert segment.reward == demo.turn_rewards[turn]
            trained_in_segments += [t for t, m in zip(segment.input_ids, segment.loss_mask, strict=True) if m]
        assert trained_in_segments == [t for t, m in zip(demo.input_ids, demo.loss_mask, strict=True) if m]


def test_warm_start_trains_on_turns_then_episodes_with_one_step_count(
    chatml_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warm_start.turn_steps`` steps on turn segments, then ``steps`` on whole episodes; the
    progress callback counts the steps of both phases in one sequence."""

    from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig, WarmStartConfig
    from ragen_tasks.training import warm_start as ws_module

    longest: list[int] = []
    supervised_steps = ws_module.supervised_steps

    def recording(model: torch.nn.Module, trajectories: list, **kwargs: object) -> list[float]:
        longest.append(max(len(t.turn_starts) for t in trajectories))
        return supervised_steps(model, trajectories, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ws_module, "supervised_steps", recording)
    model = _one_layer_model(len(chatml_tokenizer))
    config = TrainConfig(
        envs=[EnvSpec(name="frozen_lake")],
        agent=AgentConfig(max_turns=5, max_tokens_per_turn=96),
        warm_start=WarmStartConfig(episodes_per_env=16, steps=2, turn_steps=3, batch_size=4, reasoning="neighbours"),
    )
    steps: list[int] = []
    record = ws_module.warm_start(model, chatml_tokenizer, config, progress=lambda step, loss: steps.append(step))
    assert steps == [0, 1, 2, 3, 4]
    assert longest[0] == 1 and longest[1] > 1  # turn segments first, then the episodes
    assert (record["turn_steps"], record["steps"]) == (3, 2)


def _one_layer_model(vocab_size: int) -> torch.nn.Module:
    """A one-layer Qwen2 model, seeded: enough for the warm start's steps to run."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Qwen2ForCausalLM(config)
