"""The run report's panels: ``*`` keys expand to the per-env metrics a history holds."""

from ragen_tasks.report import PANELS, _expand


def test_star_keys_expand_to_the_per_env_metrics_present() -> None:
    present = {
        "rollout/success",
        "rollout/bandit/success",
        "rollout/frozen_lake/success",
        "rollout/bandit/reward_mean",
        "eval/bandit/success",
        "eval/frozen_lake/success",
        "eval/frozen_lake/sub/success",  # one segment per *: not matched
    }
    panels = dict(PANELS)
    assert _expand(panels["Success rate (rollouts)"], present) == [
        "rollout/success",
        "rollout/bandit/success",
        "rollout/frozen_lake/success",
    ]
    assert _expand(panels["Held-out evaluation success (-1 = before RL)"], present) == [
        "eval/bandit/success",
        "eval/frozen_lake/success",
    ]
    assert _expand(["actor/entropy"], present) == ["actor/entropy"]  # plain keys pass through
