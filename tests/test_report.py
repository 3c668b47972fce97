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
        "rl_gain_paired": {"sokoban": {"seeds": 256, "gains": 60, "losses": 8, "p": 1.2e-11}},
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
    row = parser.cells[parser.cells.index("sokoban") : parser.cells.index("sokoban") + 8]
    assert row == ["sokoban", "0.410", "0.620", "+4.80", "1.2e-11", "0.041", "0.977", "256"]


def test_the_report_renders_in_a_real_browser(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Headless Chromium opens report.html: every learning-curve image decodes, the trajectories
    table has rows, nothing reaches the console as an error."""
    import pytest

    from ragen_tasks.report import write_report
    from tests.browser import Page, chromium
    from tests.data._factory import make_batch

    if chromium() is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run installs it)")
    history = [
        {
            "iteration": it,
            "rollout/success": 0.2 + 0.1 * it,
            "rollout/reward_mean": 0.1 * it,
            "actor/entropy": 1.0 - 0.1 * it,
        }
        for it in range(4)
    ]
    summary = {
        "eval_before_rl": {"frozen_lake": {"success": 0.4, "episodes": 16.0}},
        "eval_after_rl": {"frozen_lake": {"success": 0.6, "episodes": 16.0}},
    }
    path = write_report(
        tmp_path / "report.html", title="browser", history=history, samples=make_batch(2), summary=summary
    )
    with Page.open(path.as_uri()) as page:
        images = page.evaluate("Array.from(document.images).map(i => [i.alt, i.complete && i.naturalWidth > 0])")
        sample_rows = page.evaluate("document.querySelectorAll('pre.resp').length")
        errors = page.errors
    assert images and all(ok for _, ok in images), images
    assert sample_rows >= 2
    assert errors == []
