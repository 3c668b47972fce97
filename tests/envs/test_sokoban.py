"""Sokoban: generated rooms are solvable (BFS plan executed in the env reaches success), push
semantics and rewards on hand-made rooms, fixed rooms in both symbol sets, bounded generation."""

from __future__ import annotations

import pytest

from ragen_tasks.envs import make
from ragen_tasks.envs.sokoban import (
    SYMBOL_SETS,
    Room,
    RoomGenerationError,
    SokobanEnv,
    SolverBudgetExceeded,
    solve,
)

# Player left of a box, target two cells right of the box.
LINE_ROOM = """
#######
#_PX_O#
#######
"""


@pytest.mark.parametrize(
    ("dim_room", "num_boxes", "seeds"), [((6, 6), 1, range(200)), ((7, 7), 1, range(40)), ((8, 8), 2, range(40))]
)
def test_every_generated_room_is_solved_by_bfs_and_the_plan_succeeds(
    dim_room: tuple[int, int], num_boxes: int, seeds: range
) -> None:
    env = make("sokoban", dim_room=dim_room, num_boxes=num_boxes, max_actions_per_episode=10_000)
    assert isinstance(env, SokobanEnv)
    lengths = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        room = Room.from_text(obs)
        assert len(room.boxes) == len(room.targets) == num_boxes and not room.solved
        plan = env.solve()
        assert plan, f"seed {seed}: no plan for\n{obs}"
        lengths.append(len(plan))
        for i, action in enumerate(plan):
            obs, reward, terminated, truncated, info = env.step(action)
            assert terminated == (i == len(plan) - 1), f"seed {seed}: ended early/late at step {i}"
        assert info["success"] and reward >= 10 - 0.1 and not truncated
    assert max(lengths) > min(lengths) >= 1  # rooms differ in difficulty
    if min(dim_room) >= 6:
        assert min(lengths) >= 2, "rooms of 6x6 and up are never solved by a single push"


def test_push_reward_and_irreversibility() -> None:
    env = make("sokoban", room=LINE_ROOM, max_actions_per_episode=50)
    obs, _ = env.reset(seed=0)
    assert obs == LINE_ROOM.strip()
    assert env.step("Up")[1:] == (
        -0.1,
        False,
        False,
        {"action_is_valid": True, "action_is_effective": False, "success": False},
    )
    obs, reward, terminated, _, info = env.step("Right")  # push the box one cell
    assert obs.splitlines()[1] == "#__PXO#" and reward == pytest.approx(-0.1) and info["action_is_effective"]
    obs, reward, terminated, _, info = env.step("right")  # onto the target: -0.1 + 1 + 10
    assert obs.splitlines()[1] == "#___P√#" and reward == pytest.approx(10.9) and terminated and info["success"]
    # Pushes are irreversible: a box pushed into a corner off target can never move again.
    env = make("sokoban", room="######\n#P___#\n#_X__#\n#___O#\n######", max_actions_per_episode=50)
    env.reset(seed=0)
    for action in ["Right", "Down", "Right", "Down"]:
        env.step(action)
    assert env.solve() is not None  # still solvable: walk round and push it right
    env.step("Left")  # box into the bottom-left corner
    assert env.render().splitlines()[3] == "#XP_O#"
    assert env.solve() is None


def test_pushing_a_box_off_a_target_costs() -> None:
    env = make("sokoban", room="######\n#P√_O#\n#_X__#\n######")
    env.reset(seed=0)
    obs, reward, *_ = env.step("Right")
    assert obs.splitlines()[1] == "#_SXO#" and reward == pytest.approx(-0.1 - 1.0)


def test_fixed_room_roundtrip_in_both_symbol_sets() -> None:
    xsb = "#######\n#@$ . #\n#######"
    env = make("sokoban", room=xsb, symbols="xsb")
    obs, _ = env.reset(seed=3)
    assert obs == xsb and env.legend[" "] == "empty floor" and env.legend["$"] == "box"
    assert env.solve() == ["Right", "Right"]
    assert Room.from_text(xsb, "xsb").to_text("ragen") == "#######\n#PX_O_#\n#######"
    assert set(SYMBOL_SETS["ragen"].legend()) == set("#_OX√PS")
    gen = make("sokoban", symbols="xsb")
    obs, _ = gen.reset(seed=1)
    assert set(obs) <= set("# .$*@+\n") and ("@" in obs or "+" in obs)


@pytest.mark.parametrize(
    ("room", "message"),
    [
        ("#####\n#P_O#\n#####", "as many boxes as targets"),
        ("#####\n#PXO#\n#X_O#", "not enclosed"),
        ("#####\n#PX?#\n#####", "unknown symbol '\\?'"),
        ("#####\n#__√#\n#P__#\n#####", "already solved"),
        ("#####\n#PXO#\n#PXO#\n#####", "exactly one player"),
    ],
)
def test_bad_fixed_rooms(room: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"sokoban\.room=.*" + message):
        make("sokoban", room=room)


def test_fixed_room_conflicting_dims_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"sokoban\.dim_room=\(6, 6\): the fixed room is 3x7"):
        make("sokoban", room=LINE_ROOM, dim_room=(6, 6))


def test_generation_gives_up_with_a_clear_error() -> None:
    env = make("sokoban", dim_room=(4, 4), generation_tries=5)  # a 2x2 inside: no pull is ever possible
    with pytest.raises(RoomGenerationError, match=r"in 5 tries.*larger dim_room"):
        env.reset(seed=0)


def test_solver_budget_is_bounded() -> None:
    env = make("sokoban", dim_room=(8, 8), num_boxes=2)
    env.reset(seed=4)
    with pytest.raises(SolverBudgetExceeded, match="more than 3 states"):
        env.solve(max_states=3)


def test_solve_accepts_text_and_finds_the_shortest_plan() -> None:
    assert solve(LINE_ROOM) == ["Right", "Right"]
    assert solve("#######\n#@$ . #\n#######", symbols="xsb") == ["Right", "Right"]
    # A room needing several pushes: the BFS plan, executed in the env, solves it.
    detour = "######\n#P___#\n#_X__#\n#____#\n#__O_#\n######"
    plan = solve(detour)
    assert plan is not None
    room = Room.from_text(detour)
    env = make("sokoban", room=detour, max_actions_per_episode=100)
    env.reset(seed=0)
    for action in plan:
        *_, info = env.step(action)
    assert info["success"] and len(plan) == len(solve(room) or [])
    assert solve(Room.from_text("#####\n#_PO#\n#___#\n#X__#\n#####")) is None  # box in a corner
