"""All three games through ``envs.make``: check_env, bad input, determinism (also across processes),
and hypothesis properties (action-name parsing, arbitrary action sequences never raising)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_tasks.envs import ENV_NAMES, canonical_action, config_model, make

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("bandit", {}),
    ("bandit", {"arm_names": ("Trader", "Librarian")}),
    ("sokoban", {}),
    ("sokoban", {"dim_room": (8, 8), "num_boxes": 2}),
    ("sokoban", {"symbols": "xsb"}),
    ("frozen_lake", {}),
    ("frozen_lake", {"desc": ["SFFF", "FHFH", "FFFH", "HFFG"]}),
]
INFO_KEYS = {"action_is_valid", "action_is_effective", "success"}


@pytest.mark.filterwarnings("ignore:.*spec.*")
@pytest.mark.parametrize(("name", "config"), VARIANTS)
def test_check_env_passes(name: str, config: dict[str, Any]) -> None:
    check_env(make(name, **config))


def test_env_names_and_config_models() -> None:
    assert ENV_NAMES == ("bandit", "sokoban", "frozen_lake")
    for name in ENV_NAMES:
        model = config_model(name)
        assert model.model_config.get("frozen") and model.model_config.get("extra") == "forbid"
        assert all(field.description for field in model.model_fields.values()), name
        assert "max_actions_per_episode" in model.model_fields


def test_unknown_env_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown env 'chess'; valid names: bandit, sokoban, frozen_lake"):
        make("chess")


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("sokoban", {"dim_room": (1, 1)}, r"sokoban\.dim_room=\(1, 1\): must be at least 3x3"),
        ("sokoban", {"num_boxes": -1}, r"sokoban\.num_boxes=-1: .*greater than or equal to 1"),
        ("sokoban", {"dim_room": (4, 4), "num_boxes": 4}, r"sokoban\.num_boxes=4: more boxes than floor.*at most 3"),
        ("sokoban", {"symbols": "emoji"}, r"sokoban\.symbols='emoji': .*'ragen' or 'xsb'"),
        ("sokoban", {"colour": "red"}, r"sokoban\.colour='red': unknown option; allowed options: .*dim_room"),
        ("frozen_lake", {"p_frozen": 0}, r"frozen_lake\.p_frozen=0: .*greater than 0"),
        ("frozen_lake", {"size": 1}, r"frozen_lake\.size=1: .*greater than or equal to 2"),
        ("frozen_lake", {"desc": ["SH", "HG"]}, r"frozen_lake\.desc=.*no path from S to G"),
        ("frozen_lake", {"desc": ["SX", "FG"]}, r"frozen_lake\.desc=.*unknown letters \['X'\]"),
        ("bandit", {"arm_names": ("A", "a")}, r"bandit\.arm_names=.*must differ"),
        ("bandit", {"probabilities": (1.5, 0.2)}, r"bandit\.probabilities=.*in \[0, 1\]"),
        ("bandit", {"max_actions_per_episode": 0}, r"bandit\.max_actions_per_episode=0"),
    ],
)
def test_bad_config_names_field_and_allowed_values(name: str, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(name, **config)


ACTION_SCRIPT = ["Up", "left", "jump", " DOWN ", "Right", "", "Phoenix", "dragon", "Down", "Left", "Up", "Right"] * 3


def _rollout(name: str, seed: int) -> list[Any]:
    env = make(name, max_actions_per_episode=30)
    obs, info = env.reset(seed=seed)
    out: list[Any] = [obs, info]
    for action in ACTION_SCRIPT:
        out.append(list(env.step(action)))
    return out


@pytest.mark.parametrize("name", ENV_NAMES)
def test_same_seed_same_five_tuples(name: str) -> None:
    assert _rollout(name, 11) == _rollout(name, 11)
    tasks = {make(name).reset(seed=s)[0] for s in range(10)}
    assert len(tasks) > 1, "different seeds should give different tasks"


def test_same_seed_same_task_in_a_fresh_process() -> None:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_registry import _rollout\n"
        "print(json.dumps({n: _rollout(n, 5) for n in ('bandit', 'sokoban', 'frozen_lake')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    here = {name: _rollout(name, 5) for name in ENV_NAMES}
    assert json.loads(done.stdout) == json.loads(json.dumps(here))


@given(
    names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5, unique_by=str.casefold),
    pick=st.integers(min_value=0),
    pad_left=st.sampled_from(["", " ", "\t", "  \n"]),
    pad_right=st.sampled_from(["", " ", "\n"]),
    upper=st.booleans(),
)
def test_canonical_action_ignores_case_and_whitespace(
    names: list[str], pick: int, pad_left: str, pad_right: str, upper: bool
) -> None:
    names = [n.strip() for n in names if n.strip()]
    if not names or len({n.casefold() for n in names}) != len(names):
        return
    name = names[pick % len(names)]
    typed = pad_left + (name.upper() if upper else name.lower()) + pad_right
    if typed.strip().casefold() == name.casefold():
        assert canonical_action(typed, names) == name


@given(text=st.text(max_size=20))
def test_canonical_action_rejects_non_names(text: str) -> None:
    names = ["Up", "Down", "Left", "Right"]
    mapped = canonical_action(text, names)
    assert (mapped is None) == (text.strip().casefold() not in {n.casefold() for n in names})


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ENV_NAMES),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    actions=st.lists(
        st.one_of(st.sampled_from(["Up", "down", "LEFT", "Right", "Phoenix", "Dragon", " up "]), st.text(max_size=8)),
        max_size=25,
    ),
)
def test_arbitrary_action_sequences_never_raise(name: str, seed: int, actions: list[str]) -> None:
    env = make(name, max_actions_per_episode=8)
    obs, info = env.reset(seed=seed)
    assert env.observation_space.contains(obs) and info == {"success": False}
    valid_count = 0
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs), obs
        assert set(info) == INFO_KEYS
        assert isinstance(reward, float)
        valid = canonical_action(action, env.action_names) is not None
        assert info["action_is_valid"] == valid
        if not valid:
            assert reward == 0.0 and not info["action_is_effective"]
        valid_count += valid
        if truncated:
            assert valid_count >= 8 and not terminated
