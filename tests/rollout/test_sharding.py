"""Sharded rollouts: N shards give one engine's trajectories for the same seeds; a failing shard
fails the whole batch, naming itself; the config knobs fail at load naming field, value and fix.

Engines: the HF engine with the real tiny model (in-process shards, and spawned processes through
``play_checkpoint``), and the openai engine against small fake vLLM servers on 127.0.0.1
(``servers`` in conftest.py) whose reply depends on the request's seed, like a sampler's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ragen_tasks import pipeline
from ragen_tasks.config import AgentConfig, EnvSpec, TrainConfig
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.models import ensure_preset, load_policy
from ragen_tasks.presets import ConfigError, load_config
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.hf_engine import HFEngine
from ragen_tasks.rollout.loop import RolloutTask, make_group_tasks, run_rollouts
from ragen_tasks.rollout.seeding import session_keys, session_seed, uniforms
from ragen_tasks.rollout.shards import RolloutShardError, run_sharded, split_groups
from tests.conftest import TINY_RUN

SPECS = [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")]
AGENT = AgentConfig(max_turns=2, max_tokens_per_turn=16, max_context_tokens=1024)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_policy("tiny", cache_dir=tmp_path_factory.mktemp("presets"))


def _same_trajectories(a: list[Trajectory], b: list[Trajectory], *, logprob_atol: float = 0.0) -> None:
    """Equal token for token, turn for turn; log-probs within ``logprob_atol`` (0 = bit for bit)."""
    assert [t.traj_id for t in a] == [t.traj_id for t in b]
    for x, y in zip(a, b, strict=True):
        assert x.input_ids == y.input_ids and x.response_mask == y.response_mask, x.traj_id
        assert (x.turn_rewards, x.status, x.success, x.turn_actions) == (
            y.turn_rewards,
            y.status,
            y.success,
            y.turn_actions,
        )
        if logprob_atol == 0:
            assert x.rollout_logprobs == y.rollout_logprobs, x.traj_id
        else:
            torch.testing.assert_close(
                torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=logprob_atol, rtol=0
            )


# ------------------------------------------------------------------------------ pure parts


def test_split_groups_keeps_groups_whole_balances_and_keeps_order() -> None:
    tasks = make_group_tasks(SPECS, groups=5, group_size=3, seed=0, iteration=0)  # 15 tasks, groups of 3
    parts = split_groups(tasks, 2)
    assert [len(p) for p in parts] == [9, 6] and sorted(i for p in parts for i in p) == list(range(15))
    for part in parts:
        assert part == sorted(part)
        groups = {tasks[i].group_id for i in part}
        assert all(sum(t.group_id == g for t in tasks) == sum(tasks[i].group_id == g for i in part) for g in groups)
    assert split_groups(tasks, 1) == [list(range(15))]
    assert len(split_groups(tasks, 8)) == 5  # fewer groups than shards: the extra shards stay idle
    # a group's tasks need not be adjacent: they still go together
    mixed = [RolloutTask(f"t{i}", "bandit", {}, 0, group_id=i % 2) for i in range(6)]
    assert split_groups(mixed, 2) == [[0, 2, 4], [1, 3, 5]]


def test_uniforms_are_splitmix64_per_key_whatever_the_batch() -> None:
    """Loop reference: the (step + 1)-th SplitMix64 output of the key, top 24 bits."""

    def splitmix(seed: int, n: int) -> int:
        mask, state = (1 << 64) - 1, seed
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            out = z ^ (z >> 31)
        return out

    keys = session_keys(7, [f"s{i}" for i in range(5)])
    table = uniforms(keys, 10)  # (5, 10)
    assert table.shape == (5, 10) and table.dtype == np.float32
    assert table.tolist() == [[(splitmix(int(k), t + 1) >> 40) / 2**24 for t in range(10)] for k in keys]
    assert uniforms(keys[2:], 10).tolist() == table[2:].tolist()  # a key's numbers ignore the other keys
    assert uniforms(keys, 3).tolist() == table[:, :3].tolist()  # and the number of steps asked for
    assert session_seed(7, "s0") == int(keys[0]) and session_seed(7, "s0") != session_seed(8, "s0")
    # the same in every process and on every machine (blake2b, never the per-process salted hash())
    assert session_seed(3, "it000000-g0000-r000") == 842927082257826743
    many = uniforms(session_keys(0, [str(i) for i in range(20_000)]), 5)
    assert many.min() >= 0 and many.max() < 1
    assert abs(many.mean() - 0.5) < 0.005 and abs(many.var() - 1 / 12) < 0.002


# ------------------------------------------------------------------------------ HF engine


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_hf_two_shards_equal_one_engine(policy, temperature: float) -> None:
    """In-process shards (threads over one model): same tokens, turns, rewards; log-probs to float
    rounding (a different batch pads differently, see hf_engine's "Batch composition")."""
    model, tok = policy
    tasks = make_group_tasks(SPECS, groups=4, group_size=2, seed=3, iteration=0)
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature, seed=5)

    def play(ts: list[RolloutTask], _options: dict[str, Any]) -> list[Trajectory]:
        return run_rollouts(
            HFEngine(model, tok), tok, ts, agent=AGENT, sampling=sampling, policy_version=0, weights_fingerprint="t"
        )

    one = play(list(tasks), {})
    two = run_sharded(tasks, [{}, {}], play, processes=False)
    _same_trajectories(one, two, logprob_atol=1e-5)
    # The same batch in another order: same padding, but a row's place in the batch can change how
    # the CPU's matrix kernel blocks rows, which moves log-probs in the last bits on some CPUs.
    backwards = play(list(reversed(tasks)), {})[::-1]
    _same_trajectories(one, backwards, logprob_atol=1e-5)


def _config(tmp_path: Path, **extra: Any) -> TrainConfig:
    return load_config("bandit-tiny", {**TINY_RUN, "store.root": str(tmp_path / "runs"), **extra})


@pytest.mark.slow  # four spawned processes, each importing torch + transformers (~5-10 s on 2 cores)
def test_hf_two_processes_equal_one_engine_and_a_failing_shard_names_itself(tmp_path: Path) -> None:
    """rollout.shards=2: two spawned processes, each loading the checkpoint folder itself."""
    folder = ensure_preset("tiny", tmp_path / "presets")
    envs = [s.model_dump() for s in SPECS]
    tasks = make_group_tasks(SPECS, groups=3, group_size=2, seed=1, iteration=0)
    kwargs = {"temperature": 1.0, "seed": 9, "policy_version": 0, "weights_fingerprint": "t"}
    one = pipeline.play_checkpoint(_config(tmp_path, envs=envs), folder, tasks, **kwargs)
    sharded = _config(tmp_path, envs=envs, **{"rollout.shards": 2})
    two = pipeline.play_checkpoint(sharded, folder, tasks, **kwargs)
    _same_trajectories(one, two, logprob_atol=1e-5)

    broken = [
        *tasks[:4],
        *(RolloutTask(t.traj_id, t.env_name, {"no_such_option": 1}, t.seed, t.group_id) for t in tasks[4:]),
    ]
    with pytest.raises(
        RolloutShardError,
        match=r"1 of 2 rollout shards failed.*shard 2/2 \(local process\), tasks it000000-g0002-r000\.\.it000000-g0002-r001: .*no_such_option",
    ):
        pipeline.play_checkpoint(sharded, folder, broken, **kwargs)


# ------------------------------------------------------------------------------ openai engine, URL list

ANSWERS = ["Left", "Right", "Up", "Down"]


def _seeded_replies(servers: list[Any], tok: Any, think: bool) -> None:
    """Each fake server answers reply_choices[seed % 4]: which move depends on the request's seed."""
    texts = [("<think>go</think>" if think else "") + f"<answer>{a}</answer>" for a in ANSWERS]
    for _, fake in servers:
        fake.reply_choices = [(t, tok.encode(t, add_special_tokens=False)) for t in texts]


def _openai_config(tmp_path: Path, urls: list[str]) -> TrainConfig:
    options: dict[str, Any] = {"model": "tiny", "timeout_s": 20}
    options.update({"base_url": urls[0]} if len(urls) == 1 else {"base_urls": urls})
    lake = [{"name": "frozen_lake", "config": {"desc": ["SFF", "FHF", "FFG"]}}]
    return _config(
        tmp_path, envs=lake, **{"rollout.engine": "openai", "rollout.engine_options": options, "agent.max_turns": 3}
    )


def test_openai_url_list_equals_one_server_and_a_failing_server_commits_nothing(tmp_path: Path, servers) -> None:
    """Two servers (one shard each, in threads) vs one server: the same requests per session (so the
    same seeds), the same trajectories; then the rollout stage with one server failing commits nothing."""
    single, pair = servers(1), servers(2)
    folder = ensure_preset("tiny", tmp_path / "presets")
    _, tok = load_policy(str(folder))
    config = _openai_config(tmp_path, [single[0][0]])
    for group in (single, pair):
        _seeded_replies(group, tok, config.agent.think)
    tasks = make_group_tasks(config.envs, groups=3, group_size=3, seed=2, iteration=0)
    kwargs = {"temperature": 1.0, "seed": 4, "policy_version": 0, "weights_fingerprint": "t"}
    one = pipeline.play_checkpoint(config, folder, tasks, **kwargs)
    two = pipeline.play_checkpoint(_openai_config(tmp_path, [u for u, _ in pair]), folder, tasks, **kwargs)
    _same_trajectories(one, two)  # the fake's log-probs are exact: bit for bit
    assert len({tuple(t.turn_actions[0]) for t in one}) > 1  # the seeds did pick different moves
    assert all(fake.bodies for _, fake in pair)  # both servers served a shard

    def seeds(fakes: list[Any]) -> list[int]:
        return sorted(b["seed"] for _, fake in fakes for b in fake.bodies)

    assert seeds(single) == seeds(pair)  # every request of every session carried the same seed
    assert {b["seed"] for b in single[0][1].bodies} >= {session_seed(4, t.traj_id) for t in tasks}  # turn 0

    # the stage: a failing server fails the rollout stage, naming its URL; nothing is committed
    run = pipeline.open_run(_openai_config(tmp_path, [u for u, _ in pair]), "url-shards")
    pipeline.init_run(run)
    pipeline.generate_tasks(run, 0)
    pair[1][1].mode = "error"
    with pytest.raises(RolloutShardError, match=rf"shard 2/2 \(server {pair[1][0]}\).*HTTP 500"):
        pipeline.rollout(run, 0)
    assert not run.store.has_manifest(run.run_id, 0, "rollouts")
    pair[1][1].mode = "token_id_strings"
    assert pipeline.rollout(run, 0)["trajectories"] == 16  # TINY_RUN: 4 groups x 4


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"rollout.engine_options": {"base_urls": ["http://a:1"]}},
            r"base_urls is for rollout.engine 'openai' \(got 'hf'\)",
        ),
        (
            {"rollout.engine": "openai", "rollout.engine_options": {"model": "m", "base_urls": []}},
            r"base_urls=\[\] must be a non-empty list",
        ),
        (
            {"rollout.engine": "openai", "rollout.engine_options": {"model": "m", "base_urls": ["http://a:1", "a:2"]}},
            r"base_urls\[1\]='a:2' must start with http://",
        ),
        (
            {
                "rollout.engine": "openai",
                "rollout.engine_options": {"model": "m", "base_urls": ["http://a:1", "http://a:1/v1"]},
            },
            "names one server twice",
        ),
        (
            {
                "rollout.engine": "openai",
                "rollout.engine_options": {"model": "m", "base_url": "http://a:1", "base_urls": ["http://b:1"]},
            },
            "both base_url and base_urls",
        ),
        (
            {
                "rollout.engine": "openai",
                "rollout.shards": 2,
                "rollout.engine_options": {"model": "m", "base_url": "http://a:1"},
            },
            r"rollout.shards=2 with rollout.engine 'openai': shard over servers with rollout.engine_options.base_urls",
        ),
        (
            {"rollout.engine": "openai", "rollout.engine_options": {"model": "m"}},
            r"needs rollout.engine_options.base_url \(one server\) or base_urls",
        ),
        (
            {"rollout.engine": "openai", "rollout.engine_options": {"base_url": "http://a:1"}},
            r"needs rollout.engine_options.model \(got None\)",
        ),
        ({"rollout.shards": 0}, r"rollout.shards=0: .*greater than or equal to 1"),
    ],
)
def test_bad_sharding_config_names_field_value_and_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("bandit-tiny", overrides)


def test_shard_engine_options() -> None:
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    config = load_config(
        "bandit-tiny", {"rollout.engine": "openai", "rollout.engine_options": {"model": "m", "base_urls": urls}}
    )
    assert config.rollout.shard_engine_options == [{"model": "m", "base_url": u} for u in urls]
    local = load_config("bandit-tiny", {"rollout.shards": 3, "rollout.engine_options": {"fast": False}})
    assert local.rollout.shard_engine_options == [{"fast": False}] * 3
    assert load_config("bandit-tiny").rollout.shard_engine_options == [{}]
