"""Does the policy read the board? Its reasoning, sentence by sentence, against the board it saw.

A warm start teaches reasoning that restates what the board says (``warm_start.reasoning``:
``relative`` or ``neighbours``; ``training.warm_start.demo_reasoning``). This reads a run's rollouts
from its store and, for every turn, rebuilds the game from the turn's board, writes the reasoning
the demonstrator would have written for it, and compares it with what the policy wrote: per
sentence (``The goal is ...``, ``Left hole.``, ...), the share of turns where the policy's sentence
is the right one. A policy that acts on a wrong reading of the board cannot imitate a planner that
reads it right, whatever it learns about acting.

Usage::

    python bench/perception.py STORE RUN_ID [--iterations 0 59] [--style neighbours]

``STORE`` is the run's store root (a folder, ``file://`` or ``s3://``); the rollouts are sampled at
the rollout temperature, so this is what RL trained on.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from ragen_tasks.data.store import Store
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make
from ragen_tasks.envs.base import TextGame
from ragen_tasks.training.warm_start import demo_reasoning

_SENTENCE = re.compile(r"[^.]+\.")


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
    """What a sentence is about: ``The goal``, ``Left``, ``The box`` ..."""
    words = sentence.split()
    return " ".join(words[:2]) if words[0] == "The" else words[0]


def read_rate(trajectories: list[Trajectory], style: str) -> tuple[int, Counter[str], Counter[str]]:
    """(turns read, sentence label -> turns whose sentence was right, label -> turns with that sentence expected)."""
    right: Counter[str] = Counter()
    expected: Counter[str] = Counter()
    turns = 0
    for trajectory in trajectories:
        for board, think in zip(trajectory.turn_observations, trajectory.turn_think, strict=True):
            env = game_at(trajectory.env_name, board)
            if env is None:
                continue
            turns += 1
            written = set(sentences(think))
            for sentence in sentences(demo_reasoning(env, style)):
                expected[label(sentence)] += 1
                right[label(sentence)] += sentence in written
    return turns, right, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="the run's store root")
    parser.add_argument("run_id")
    parser.add_argument("--iterations", type=int, nargs="+", default=[0], help="iterations whose rollouts to read")
    parser.add_argument(
        "--style", default="neighbours", choices=["relative", "neighbours"], help="the run's warm_start.reasoning"
    )
    args = parser.parse_args()

    store = Store(args.store)
    print(f"{args.run_id}: the share of turns whose reasoning states the board right, per sentence")
    header: list[str] | None = None
    for iteration in args.iterations:
        trajectories, _ = store.read_trajectories(args.run_id, iteration, "rollouts")
        turns, right, expected = read_rate(trajectories, args.style)
        if header is None:
            header = list(expected)
            print("| iteration | turns | " + " | ".join(header) + " |")
            print("|---" * (len(header) + 2) + "|")
        rates = [f"{right[k] / expected[k]:.3f}" if expected[k] else "-" for k in header]
        print(f"| {iteration} | {turns} | " + " | ".join(rates) + " |")


if __name__ == "__main__":
    main()
