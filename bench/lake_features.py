"""What a FrozenLake policy can reach if it reads only some of the board: the worth of each reading.

For each feature set (what the policy knows of the board each turn) this builds a lookup policy:
the slip-aware planner (``envs.frozen_lake.turn_planner``, the warm start's demonstrator) plays
``--train`` lakes, and for every feature value the lookup keeps the planner's most frequent turn.
It then plays ``--test`` held-out lakes (from 2,000,000) with the lookup and prints its success
beside the planner's, and the share of the lookup's turns that were the planner's own turn
(comparable with ``bench/perception.py``'s ``Planner's turn`` for a model). A model that imitates
the planner through a reading of the board can do no better than the lookup of that reading (up to
sampling), so this says which readings are worth teaching in the warm start's reasoning
(``warm_start.reasoning``). ``--demo-actions-per-turn N`` makes the demonstrator a planner of at
most N actions a turn (``warm_start.demo_actions_per_turn``) while the lookups may still play 3.
The last column is the share of held-out turns whose reading no training lake showed (the lookup
plays a fallback move there): readings with many values need more ``--train`` lakes.

Feature sets:

* ``goal``: where the goal lies from the player (what ``relative`` reasoning states);
* ``goal+turn``: and the turn (the prompt says the turns and actions left);
* ``goal+neighbours``: and what lies one step away on each side: hole, frozen, goal or wall (off the board)
  (what ``neighbours`` reasoning states);
* ``goal+neighbours+turn``;
* ``goal+neighbours+budget``: and the turns and actions left, both (the planner's own budget);
* ``goal+neighbours+diagonals`` (``+turn``): and the four cells one step away diagonally (what
  ``neighbours-diagonals`` (``-turns``) reasoning states);
* ``goal+sides`` (``+turn``): the neighbours as a reader of the player's own row sees them: a hole
  above or below reads ``frozen`` (walls and the goal there still read right, as the goal's place
  and the player's row give them away). This is what ``bench/perception.py --by-value`` finds the
  ``tiny-rows`` model reading.

Usage::

    python bench/lake_features.py [--train 20000] [--test 4000] [--demo-actions-per-turn 3]

The paper's lake: 4x4, p = 0.8, slippery (1/3 intended), 5 turns of up to 3 actions, 10 actions.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable

from ragen_tasks.envs.frozen_lake import ACTIONS as ACTION_NAMES
from ragen_tasks.envs.frozen_lake import FrozenLakeEnv

TURNS, ACTIONS, PER_TURN = 5, 10, 3
Turn = tuple[str, ...]


def features(env: FrozenLakeEnv, kind: str, turn: int, actions_left: int) -> tuple[object, ...]:
    (row, col), (goal_row, goal_col) = env.position, env.goal
    reading: tuple[object, ...] = (goal_row - row, goal_col - col)
    if "neighbours" in kind:
        reading += env.neighbours
    if "sides" in kind:
        reading += tuple(
            "frozen" if word == "hole" and action in ("Up", "Down") else word
            for action, word in zip(ACTION_NAMES, env.neighbours, strict=True)
        )
    if "diagonals" in kind:
        reading += env.diagonals
    if "turn" in kind:
        reading += (turn,)
    if "budget" in kind:
        reading += (turn, actions_left)
    return reading


def planner_turn(env: FrozenLakeEnv, turn: int, actions_left: int, per_turn: int) -> Turn:
    """The slip-aware planner's best turn of at most ``per_turn`` actions."""
    planner = env.planner(turns=TURNS, actions=ACTIONS, max_actions_per_turn=per_turn)
    return planner.best(env.cell, TURNS - turn, actions_left)


Policy = Callable[[FrozenLakeEnv, int, int], Turn]


def play(env: FrozenLakeEnv, seed: int, policy: Policy, demonstrator: Policy, agreement: Counter[bool]) -> bool:
    """One episode under the agent's rules (``policy(env, turn, actions_left)`` names a turn's
    actions, run without seeing the board in between); True if it reaches the goal. ``agreement``
    counts the turns whose actions were (True) or were not the ``demonstrator``'s."""
    env.reset(seed=seed)
    actions_left = ACTIONS
    for turn in range(TURNS):
        chosen = policy(env, turn, actions_left)
        agreement[chosen == demonstrator(env, turn, actions_left)] += 1
        for action in (chosen or ("Down",))[: min(PER_TURN, actions_left)]:
            _, reward, terminated, truncated, _ = env.step(action)
            actions_left -= 1
            if terminated or truncated:
                return reward > 0
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=20000, help="lakes the planner plays to fill the lookups")
    parser.add_argument("--test", type=int, default=4000, help="held-out lakes each policy plays")
    parser.add_argument(
        "--demo-actions-per-turn",
        type=int,
        default=PER_TURN,
        choices=range(1, PER_TURN + 1),
        help="the demonstrating planner's actions per turn at most (the lookups may play up to 3)",
    )
    args = parser.parse_args()

    def demonstrator(env: FrozenLakeEnv, turn: int, actions_left: int) -> Turn:
        return planner_turn(env, turn, actions_left, args.demo_actions_per_turn)

    kinds = (
        "goal",
        "goal+turn",
        "goal+neighbours",
        "goal+neighbours+turn",
        "goal+neighbours+budget",
        "goal+neighbours+diagonals",
        "goal+neighbours+diagonals+turn",
        "goal+sides",
        "goal+sides+turn",
    )
    env = FrozenLakeEnv(max_actions_per_episode=ACTIONS)
    counts: dict[str, defaultdict[tuple[object, ...], Counter[Turn]]] = {k: defaultdict(Counter) for k in kinds}

    def recording_planner(env: FrozenLakeEnv, turn: int, actions_left: int) -> Turn:
        chosen = demonstrator(env, turn, actions_left)
        for kind in kinds:
            counts[kind][features(env, kind, turn, actions_left)][chosen] += 1
        return chosen

    for seed in range(args.train):
        play(env, 10_000_000 + seed, recording_planner, demonstrator, Counter())

    print(
        f"| reading of the board | feature values | success on {args.test} held-out lakes | the planner's turn "
        "| turns with a reading never seen in training |"
    )
    print("|---|---|---|---|---|")
    for kind in kinds:
        lookup = {value: turns.most_common(1)[0][0] for value, turns in counts[kind].items()}

        unseen: Counter[bool] = Counter()  # True: a turn whose reading the lookup has no entry for

        def policy(
            env: FrozenLakeEnv, turn: int, left: int, kind: str = kind, lookup: dict = lookup, unseen: Counter = unseen
        ) -> Turn:
            reading = features(env, kind, turn, left)
            unseen[reading not in lookup] += 1
            return lookup.get(reading, ())  # () plays the fallback move

        agreement: Counter[bool] = Counter()
        wins = sum(play(env, 2_000_000 + seed, policy, demonstrator, agreement) for seed in range(args.test))
        share = agreement[True] / agreement.total()
        missing = unseen[True] / unseen.total()
        print(f"| {kind} | {len(lookup)} | {wins / args.test:.3f} | {share:.3f} | {missing:.3f} |")
    agreement = Counter()
    wins = sum(play(env, 2_000_000 + seed, demonstrator, demonstrator, agreement) for seed in range(args.test))
    print(
        f"| the whole board (the planner) | - | {wins / args.test:.3f} | {agreement[True] / agreement.total():.3f} | - |"
    )


if __name__ == "__main__":
    main()
