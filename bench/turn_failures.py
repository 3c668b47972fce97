"""Where a run's malformed turns are: per iteration, its rollouts split by whether an episode has a
malformed turn (an answer that cannot be parsed or names an invalid action).

Per iteration it prints one markdown row: the share of episodes with a malformed turn; success with /
without one; the mean group-centred reward (the episode's reward minus the mean of its group, GRPO's
advantage before any filter) with / without one; and on which turn (0-based) each such episode's first
malformed answer came. Rollouts are read through the store (manifests and checksums checked).

Usage::

    python bench/turn_failures.py RUN_FOLDER ITERATION [ITERATION ...]
    python bench/turn_failures.py /tmp/exp/runs/sok7 20 40 55
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def row(run_dir: Path, iteration: int) -> str:
    from ragen_tasks import pipeline
    from ragen_tasks.data.trajectory import Trajectory

    run = pipeline.open_existing_run(str(run_dir))
    episodes, _ = run.store.read_trajectories(run.run_id, iteration, "rollouts")
    groups: dict[int, list[float]] = {}
    for episode in episodes:
        groups.setdefault(episode.group_id, []).append(episode.reward)
    centred = {id(e): e.reward - statistics.fmean(groups[e.group_id]) for e in episodes}
    first_malformed = {id(e): next((t for t, ok in enumerate(e.turn_format_ok) if not ok), None) for e in episodes}
    with_bad = [e for e in episodes if first_malformed[id(e)] is not None]
    without = [e for e in episodes if first_malformed[id(e)] is None]

    def mean(values: list[float]) -> str:
        return f"{statistics.fmean(values):+.2f}" if values else "-"

    def rate(group: list[Trajectory]) -> str:
        return f"{statistics.fmean(float(e.success) for e in group):.2f}" if group else "-"

    turns = Counter(first_malformed[id(e)] for e in with_bad)
    max_turns = max((len(e.turn_format_ok) for e in episodes), default=0)
    return (
        f"| {run.run_id}, {iteration} | {len(with_bad) / len(episodes):.2f} | {rate(with_bad)} / {rate(without)} "
        f"| {mean([centred[id(e)] for e in with_bad])} / {mean([centred[id(e)] for e in without])} "
        f"| {' / '.join(str(turns[t]) for t in range(max_turns))} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder (inside a local store)")
    parser.add_argument("iterations", type=int, nargs="+")
    args = parser.parse_args()
    print(
        "| run, iteration | episodes with a malformed turn | success with / without | group-centred reward "
        "with / without | turn of the first malformed answer (count per turn) |"
    )
    print("|---|---|---|---|---|")
    for iteration in args.iterations:
        print(row(args.run, iteration), flush=True)


if __name__ == "__main__":
    main()
