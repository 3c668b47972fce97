"""make_group_tasks / make_eval_tasks: groups share a seed, seeds are deterministic, envs mixed by weight,
a curriculum keeps initial states with long enough solutions."""

from __future__ import annotations

from collections import Counter

import pytest

from ragen_tasks.config import EnvSpec
from ragen_tasks.envs import make
from ragen_tasks.rollout import loop
from ragen_tasks.rollout.loop import make_eval_tasks, make_group_tasks

SPECS = [EnvSpec(name="bandit", weight=1.0), EnvSpec(name="sokoban", weight=3.0, config={"num_boxes": 1})]


def test_groups_share_the_initial_state_and_differ_between_groups() -> None:
    tasks = make_group_tasks(SPECS, groups=8, group_size=4, seed=0, iteration=2)
    assert len(tasks) == 32 and len({t.traj_id for t in tasks}) == 32
    by_group: dict[int, set[tuple[str, int]]] = {}
    for t in tasks:
        by_group.setdefault(t.group_id, set()).add((t.env_name, t.seed))
    assert all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v))[1] for v in by_group.values()}) == 8  # distinct seeds (astronomically likely)
    counts = Counter(next(iter(v))[0] for v in by_group.values())
    assert counts == {"bandit": 2, "sokoban": 6}
    assert all(t.env_config == {"num_boxes": 1} for t in tasks if t.env_name == "sokoban")


def test_seeds_are_deterministic_and_depend_on_iteration_and_seed() -> None:
    a = make_group_tasks(SPECS, groups=4, group_size=2, seed=1, iteration=0)
    assert a == make_group_tasks(SPECS, groups=4, group_size=2, seed=1, iteration=0)
    b = make_group_tasks(SPECS, groups=4, group_size=2, seed=1, iteration=1)
    c = make_group_tasks(SPECS, groups=4, group_size=2, seed=2, iteration=0)
    assert [t.seed for t in a] != [t.seed for t in b] and [t.seed for t in a] != [t.seed for t in c]
    assert all(0 <= t.seed < 1_000_000 for t in a + b + c)


def test_largest_remainder_split_and_offsets() -> None:
    tasks = make_group_tasks(
        [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")],
        groups=4,
        group_size=1,
        seed=0,
        iteration=0,
        seed_offset=5000,
        seed_space=10,
    )
    assert sorted(Counter(t.env_name for t in tasks).values()) == [1, 1, 2]
    assert all(5000 <= t.seed < 5010 for t in tasks)


def test_eval_tasks_use_held_out_seeds() -> None:
    tasks = make_eval_tasks(SPECS, num_seeds=3, seed_offset=1_000_000)
    assert [t.seed for t in tasks] == [1_000_000, 1_000_001, 1_000_002] * 2
    assert len({t.traj_id for t in tasks}) == 6 and len({t.group_id for t in tasks}) == 6


@pytest.mark.parametrize("kw", [{"groups": 0}, {"group_size": 0}, {"seed": -1}])
def test_bad_arguments(kw: dict[str, int]) -> None:
    args = {"groups": 2, "group_size": 2, "seed": 0, "iteration": 0, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        make_group_tasks(SPECS, **args)


def _plan_length(seed: int) -> int | None:
    env = make("sokoban")
    env.reset(seed=seed)
    plan = env.solve()  # type: ignore[attr-defined]
    return None if plan is None else len(plan)


def test_curriculum_keeps_initial_states_with_long_enough_plans() -> None:
    sokoban = [EnvSpec(name="sokoban")]
    plain = make_group_tasks(sokoban, groups=24, group_size=2, seed=4, iteration=3)
    hard = make_group_tasks(sokoban, groups=24, group_size=2, seed=4, iteration=3, min_plan_length=7)
    assert hard == make_group_tasks(sokoban, groups=24, group_size=2, seed=4, iteration=3, min_plan_length=7)
    plain_lengths = [_plan_length(t.seed) for t in plain[::2]]
    hard_lengths = [_plan_length(t.seed) for t in hard[::2]]
    # Long enough, and winnable within the episode's 10 actions (the game's own mix has rooms that are not).
    assert all(n is not None and 7 <= n <= 10 for n in hard_lengths)
    assert any(n is None or n < 7 for n in plain_lengths)  # the game's own distribution has easier rooms
    # A group whose first draw already qualifies keeps it: the curriculum only replaces the easy ones.
    for p, h, n in zip(plain[::2], hard[::2], plain_lengths, strict=True):
        if n is not None and n >= 7:
            assert h.seed == p.seed
    assert [(t.group_id, t.traj_id) for t in hard] == [(t.group_id, t.traj_id) for t in plain]


def test_curriculum_share_mixes_long_plans_with_the_games_own_rooms() -> None:
    sokoban = [EnvSpec(name="sokoban")]
    plain = make_group_tasks(sokoban, groups=24, group_size=2, seed=4, iteration=3)
    full = make_group_tasks(sokoban, groups=24, group_size=2, seed=4, iteration=3, min_plan_length=7)
    mixed = make_group_tasks(
        sokoban, groups=24, group_size=2, seed=4, iteration=3, min_plan_length=7, long_plan_share=0.25
    )
    # The first round(0.25 * 24) = 6 groups are the curriculum's; the other 18 are the game's own draws.
    assert [t.seed for t in mixed[: 6 * 2]] == [t.seed for t in full[: 6 * 2]]
    assert [t.seed for t in mixed[6 * 2 :]] == [t.seed for t in plain[6 * 2 :]]
    assert any(t.seed != p.seed for t, p in zip(mixed[6 * 2 :], full[6 * 2 :], strict=True))
    with pytest.raises(ValueError, match=r"long_plan_share=0 must be in \(0, 1\]"):
        make_group_tasks(sokoban, groups=2, group_size=1, seed=0, iteration=0, min_plan_length=7, long_plan_share=0)


def test_curriculum_errors_name_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"rollout.min_plan_length=3 needs a game with a solver.*bandit has none"):
        make_group_tasks([EnvSpec(name="bandit")], groups=1, group_size=1, seed=0, iteration=0, min_plan_length=3)
    monkeypatch.setattr(loop, "CURRICULUM_DRAWS", 5)
    with pytest.raises(
        ValueError, match=r"min_plan_length=11: none of 5 .* within max_actions_per_episode=10; lower it"
    ):
        make_group_tasks([EnvSpec(name="sokoban")], groups=1, group_size=1, seed=0, iteration=0, min_plan_length=11)
