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


def test_the_report_opens_with_the_per_game_results_beside_random_play_and_the_ceiling(tmp_path) -> None:
    import html.parser

    from ragen_tasks.report import write_report

    summary = {
        "eval_before_rl": {"sokoban": {"success": 0.41, "episodes": 256.0}},
        "eval_after_rl": {"sokoban": {"success": 0.62, "episodes": 256.0}},
        "reference": {"sokoban": {"ceiling": 0.977, "random": 0.041}},
        "rl_gain_z": {"sokoban": 4.8},
    }
    page = write_report(tmp_path / "report.html", title="t", history=[], summary=summary).read_text()

    class Cells(html.parser.HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.cells: list[str] = []

        def handle_data(self, data: str) -> None:
            self.cells.append(data)

    parser = Cells()
    parser.feed(page[page.index("Held-out success per game") :])
    row = parser.cells[parser.cells.index("sokoban") : parser.cells.index("sokoban") + 7]
    assert row == ["sokoban", "0.410", "0.620", "+4.80", "0.041", "0.977", "256"]
