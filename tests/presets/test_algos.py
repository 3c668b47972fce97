"""The paper's algorithm presets load, validate and differ where the paper says."""

import pytest

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.presets.algos import available_algo_presets, load_algo_preset


def test_algo_presets():
    assert available_algo_presets() == ["starpo-grpo", "starpo-ppo", "starpo-s"]
    ppo, grpo, s = (AlgoConfig(**load_algo_preset(n)["algo"]) for n in ("starpo-ppo", "starpo-grpo", "starpo-s"))
    assert (ppo.advantage, ppo.kl_mode, ppo.kl_coef, ppo.kl_estimator) == ("gae", "in_reward", 0.001, "k1")
    assert (ppo.clip_low, ppo.clip_high, ppo.filter_keep_ratio) == (0.2, 0.2, 1.0)
    assert grpo.advantage == "grpo" and grpo.kl_mode == "in_loss"
    assert (s.advantage, s.kl_mode, s.clip_high, s.filter_keep_ratio) == ("gae", "none", 0.28, 0.25)
    OptimConfig(**load_algo_preset("starpo-s")["optim"])
    with pytest.raises(ValueError, match="known: starpo-grpo"):
        load_algo_preset("starpo-x")
