"""Does the policy read the board? Its reasoning, sentence by sentence, against the board it saw.

A warm start teaches reasoning that restates what the board says (``warm_start.reasoning``:
``relative``, ``neighbours``, ``neighbours-diagonals`` and their ``-turns`` forms;
``training.warm_start.demo_reasoning``). This reads a run's rollouts
from its store and, for every turn, rebuilds the game from the turn's board, writes the reasoning
the demonstrator would have written for it, and compares it with what the policy wrote: per
sentence (``The goal is ...``, ``Left hole.``, ...), the share of turns where the policy's sentence
is the right one. A policy that acts on a wrong reading of the board cannot imitate a planner that
reads it right, whatever it learns about acting. ``--by-value`` splits each cell's sentence by what
the cell holds (``Up=hole``, ``Up=frozen``, ...): a rate near 0.9 can be a cell read right whenever it
is common and never when it is rare, the case that matters. On FrozenLake one more column, ``Planner's turn``,
says how often the turn's actions were the slip-aware planner's (the warm start's demonstrator, for
the board, the turns and the actions left, under ``warm_start.demo_actions_per_turn`` where the run
set it): what the policy does with what it read.

Usage::

    python bench/perception.py STORE RUN_ID [--iterations 0 59] [--style neighbours-diagonals]
    python bench/perception.py --checkpoints CKPT [CKPT ...] [--seeds 1024] [--temperature 0] [--style ...]
    (either form) [--by-value]

The first form reads a run's training rollouts from its store (a folder, ``file://`` or ``s3://``),
sampled at the rollout temperature: what RL trained on. An iteration's rollouts hold few boards
(``rollout.groups`` initial states), different in every iteration, so its rate moves with the
boards drawn as much as with the policy. The second form plays each checkpoint on the same held-out
seeds (``evaluate_checkpoint``) and compares the checkpoints on equal terms: the first turn reads the
same boards for every checkpoint; later turns read the boards each policy led to.
"""

from __future__ import annotations

import argparse
import itertools
import re
import typing
from collections import Counter
from pathlib import Path

from ragen_tasks.config import AgentConfig, TrainConfig, WarmStartConfig
from ragen_tasks.data.store import Store
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make
from ragen_tasks.envs.base import TextGame
from ragen_tasks.envs.frozen_lake import ACTIONS
from ragen_tasks.training.warm_start import demo_reasoning, demonstrator_agent, lake_planner

_SENTENCE = re.compile(r"[^.]+\.")
_DIRECTIONS = set(ACTIONS)  # Up, Down, Left, Right: the words both grid games' directions are named in
#: The reasoning styles that read the board (``WarmStartConfig.reasoning`` less ``fixed``).
STYLES = [style for style in typing.get_args(WarmStartConfig.model_fields["reasoning"].annotation) if style != "fixed"]


def game_at(env_name: str, board: str) -> TextGame | None:
    """The game in the state ``board`` shows (the board's rows only), or None if it cannot be rebuilt
    (a player in a hole or on the goal: the episode is over, nothing to reason about)."""
    rows = [row for row in board.split("\n") if row and not row.endswith(".")]
    if env_name == "sokoban":
        env = make("sokoban", room="\n".join(rows))
    elif env_name == "frozen_lake":
        letters = {"P": "S", "_": "F", "O": "H", "G": "G"}
        if any(ch not in letters for row in rows for ch in row):
            return None
        env = make("frozen_lake", desc=["".join(letters[ch] for ch in row) for row in rows])
    else:
        return None
    env.reset(seed=0)
    return env


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.findall(text)]


def label(sentence: str) -> str:
    """What a sentence is about: ``The goal``, ``Left``, ``Up Left``, ``The box``, ``Turns`` ..."""
    words = sentence.split()
    direction = list(itertools.takewhile(lambda word: word in _DIRECTIONS, words))
    if direction:
        return " ".join(direction)
    return " ".join(words[:2]) if words[0] == "The" else words[0]


def column(sentence: str, by_value: bool) -> str:
    """The table column a sentence counts in: its ``label``, or with ``by_value`` a cell's sentence
    split by what the cell holds (``Up Left hole.`` -> ``Up Left=hole``)."""
    name = label(sentence)
    if by_value and name.split()[0] in _DIRECTIONS:
        return f"{name}={sentence.split()[-1].rstrip('.')}"
    return name


def played_planners_turn(trajectory: Trajectory, turn: int, env: TextGame, agent: AgentConfig) -> bool:
    """Whether FrozenLake turn ``turn`` played the planner's actions for its board and budget (a turn
    the episode ended midway matches on the actions it ran)."""
    actions_left = agent.max_actions_per_episode - sum(len(a) for a in trajectory.turn_actions[:turn])
    cell = getattr(env, "cell")  # noqa: B009 (FrozenLakeEnv.cell; TextGame does not declare it)
    best = list(lake_planner(env, agent).best(cell, agent.max_turns - turn, actions_left))
    played = trajectory.turn_actions[turn]
    last = turn == trajectory.num_turns - 1
    return played == best or (last and bool(played) and played == best[: len(played)])


def read_rate(
    trajectories: list[Trajectory],
    style: str,
    agent: AgentConfig,
    first_turns: int | None = None,
    by_value: bool = False,
) -> tuple[int, Counter[str], Counter[str]]:
    """(turns read, column -> turns whose sentence was right, column -> turns with that sentence
    expected; a sentence counts in its ``column``), over every turn of each trajectory or its first
    ``first_turns``; ``agent`` is the demonstrator's (``demonstrator_agent``: the run's turns and
    actions, the demonstrations' actions per turn; turn i of an episode has ``agent.max_turns - i``
    turns left)."""
    right: Counter[str] = Counter()
    expected: Counter[str] = Counter()
    turns = 0
    for trajectory in trajectories:
        pairs = list(zip(trajectory.turn_observations, trajectory.turn_think, strict=True))
        for turn, (board, think) in enumerate(pairs[:first_turns]):
            env = game_at(trajectory.env_name, board)
            if env is None:
                continue
            turns += 1
            written = set(sentences(think))
            for sentence in sentences(demo_reasoning(env, style, turns_left=agent.max_turns - turn)):
                key = column(sentence, by_value)
                expected[key] += 1
                right[key] += sentence in written
            if trajectory.env_name == "frozen_lake":
                expected["Planner's turn"] += 1
                right["Planner's turn"] += played_planners_turn(trajectory, turn, env, agent)
    return turns, right, expected


def print_rates(rows: list[tuple[str, int, Counter[str], Counter[str]]], first_column: str) -> None:
    """A markdown table: per row (name, turns, right, expected), each sentence's share read right."""
    keys = list(dict.fromkeys(key for *_, expected in rows for key in expected))
    sentences_in_order = list(dict.fromkeys(key.split("=")[0] for key in keys))  # as the reasoning writes them
    header = sorted(keys, key=lambda key: (sentences_in_order.index(key.split("=")[0]), key))
    print(f"| {first_column} | turns | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 2) + "|")
    for name, turns, right, expected in rows:
        rates = [f"{right[k] / expected[k]:.3f}" if expected[k] else "-" for k in header]
        print(f"| {name} | {turns} | " + " | ".join(rates) + " |")


def checkpoint_rates(args: argparse.Namespace) -> list[tuple[str, int, Counter[str], Counter[str]]]:
    """Each checkpoint played on the same held-out seeds: rows for its first turns and for all turns."""
    from ragen_tasks.pipeline import run_of_checkpoint
    from ragen_tasks.pipeline.policy import evaluate_checkpoint

    rows = []
    for folder in args.checkpoints:
        run = run_of_checkpoint(Path(folder))
        if run is None:
            raise SystemExit(f"--checkpoints {folder}: not a checkpoint inside a run folder (no config to play it by)")
        _, trajectories = evaluate_checkpoint(
            run.config, Path(folder), seeds=args.seeds, seed_offset=args.seed_offset, temperature=args.temperature
        )
        name = str(folder)
        agent = demonstrator_agent(run.config)
        style = args.style or run.config.warm_start.reasoning
        rows.append((f"{name}, first turn", *read_rate(trajectories, style, agent, 1, args.by_value)))
        rows.append((f"{name}, all turns", *read_rate(trajectories, style, agent, None, args.by_value)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", nargs="?", help="the run's store root")
    parser.add_argument("run_id", nargs="?")
    parser.add_argument("--iterations", type=int, nargs="+", default=[0], help="iterations whose rollouts to read")
    parser.add_argument(
        "--style",
        choices=STYLES,
        help="the reasoning to compare with (default: the run's own warm_start.reasoning)",
    )
    parser.add_argument("--checkpoints", nargs="+", help="checkpoint folders to play on the same held-out seeds")
    parser.add_argument("--seeds", type=int, default=1024, help="held-out seeds per checkpoint (--checkpoints)")
    parser.add_argument("--seed-offset", type=int, default=2_000_000, help="first held-out seed (--checkpoints)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (--checkpoints)")
    parser.add_argument(
        "--by-value", action="store_true", help="split each cell's sentence by what the cell holds (Up=hole, ...)"
    )
    args = parser.parse_args()
    if bool(args.checkpoints) == bool(args.store and args.run_id):
        parser.error("give either STORE RUN_ID (training rollouts) or --checkpoints (held-out play), not both")

    if args.checkpoints:
        print(f"held-out seeds {args.seed_offset}.. ({args.seeds}), T {args.temperature}: the share of turns whose")
        print("reasoning states the board right, per sentence")
        print_rates(checkpoint_rates(args), "checkpoint")
        return
    store = Store(args.store)
    print(f"{args.run_id}: the share of turns whose reasoning states the board right, per sentence")
    config, _ = store.read_json(args.run_id, 0, "summary", "config")
    run_config = TrainConfig.model_validate(config)
    agent = demonstrator_agent(run_config)
    style = args.style or run_config.warm_start.reasoning
    rows = []
    for iteration in args.iterations:
        trajectories, _ = store.read_trajectories(args.run_id, iteration, "rollouts")
        rows.append((str(iteration), *read_rate(trajectories, style, agent, None, args.by_value)))
    print_rates(rows, "iteration")


if __name__ == "__main__":
    main()
