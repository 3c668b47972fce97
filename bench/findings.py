"""The paper's three findings at CPU scale, each over several seeds, through the real CLI.

* ``collapse``: vanilla StarPO (GRPO and PPO, as the paper defines them: symmetric clip 0.2, KL to
  the reference, no uncertainty filter, every row kept) against StarPO-S (the game presets'
  own algorithm: no KL, clip-higher 0.28, uncertainty filter, zero-advantage rows dropped) on each
  game preset. Per run: held-out success after RL, the first iteration where the Echo-Trap
  detector fires (replayed over the history with the default rules) and which rules, the first
  iteration whose rollout success stays below half of iteration 0's, and entropy / in-group std at
  the end relative to iteration 0.
* ``freshness``: Online-1 (the preset: a fresh rollout batch for every update round) against
  Online-K (K times the rollout groups once every K iterations, so the same episodes and the same
  number of optimizer steps, but the last updates learn from rollouts K-1 rounds old). Filter and
  minibatch size are unchanged.
* ``granularity``: actions per turn (``agent.max_actions_per_turn``) 1 / 2 / 3 / 5 with the same
  episode budget (each setting has its own warm start: the demonstrations follow the agent's turn;
  the preset's own setting is the preset's run, the one ``bench/science.py`` makes).

Every run is ``ragen train PRESET --set seed=S --set ...`` (as a user would run it, wall time
measured); held-out success comes from the run's own summary (``eval.seeds`` seeds from
``eval.seed_offset``, at the preset's ``eval.temperature``). Prints a markdown table per finding
(and appends it to ``--out``) for ``bench/RESULTS.md``.

Usage::

    python bench/findings.py collapse --presets bandit frozenlake --seeds 0 1 2
    python bench/findings.py collapse --presets frozenlake --arms "StarPO-S" "vanilla GRPO"
    python bench/findings.py freshness --presets frozenlake --seeds 0 1 2 --staleness 5
    python bench/findings.py granularity --presets frozenlake --seeds 0 1 2 --actions 1 2 3 5
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trap import first_firing, success_drop  # bench/echo_trap.py
from science import train  # bench/science.py


def vanilla(algo_preset: str, *extra: str) -> list[str]:
    """The paper's algorithm settings (``presets/algos/NAME.yaml``, its ``algo`` section) as overrides
    of a game preset, every row kept (no zero-advantage drop: that is StarPO-S's). The optimizer
    stays the game preset's (CPU learning rates): the comparison is the algorithm, not the step size."""
    from ragen_tasks.presets.algos import load_algo_preset

    algo = load_algo_preset(algo_preset)["algo"]
    return [
        *(f"algo.{key}={json.dumps(value)}" for key, value in algo.items()),
        "algo.drop_zero_advantage=false",
        *extra,
    ]


def measured(summary: dict[str, Any], store: Path, wall: float) -> dict[str, Any]:
    """What a finding reports of one finished run."""
    from ragen_tasks import guard, pipeline

    run = pipeline.open_existing_run(str(store / summary["run_id"]))
    rows = pipeline.history(run)
    env = next(iter(summary["eval_after_rl"]))
    fired, rules = first_firing(rows, guard.rules(run.config.guard))
    reference = summary.get("reference", {}).get(env, {})  # random play and the ceiling on the same seeds

    def ratio(key: str) -> float:
        """The metric at the last iteration that has it over its value at the first."""
        values = [float(row[key]) for row in rows if row.get(key) is not None]
        return values[-1] / values[0] if values and values[0] else math.nan

    return {
        "run_id": summary["run_id"],
        "before": summary["eval_before_rl"][env]["success"],
        "after": summary["eval_after_rl"][env]["success"],
        "z": summary.get("rl_gain_z", {}).get(env, math.nan),
        "random": reference.get("random", math.nan),
        "ceiling": reference.get("ceiling", math.nan),
        "fired": fired,
        "rules": rules,
        "drop": success_drop(rows, fraction=0.5, patience=2),
        "entropy_ratio": ratio("actor/entropy"),
        "std_ratio": ratio("rollout/in_group_std"),
        "wall_min": wall / 60,
    }


def variants(finding: str, preset: str, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, overrides) of each arm of ``finding`` on ``preset``."""
    from ragen_tasks.presets import load_config

    if finding == "collapse":
        vanilla_ppo = vanilla("starpo-ppo", "optim.critic_lr=1e-3")  # the critic learns at the CPU actor's scale
        return [("StarPO-S", []), ("vanilla GRPO", vanilla("starpo-grpo")), ("vanilla PPO", vanilla_ppo)]
    if finding == "freshness":
        config = load_config(preset, [])
        k = args.staleness
        stale = [f"rollout.groups={config.rollout.groups * k}", f"iterations={max(1, config.iterations // k)}"]
        stale += [f"eval.every={max(1, config.eval.every // k)}"]
        return [("Online-1", []), (f"Online-{k}", stale)]
    # The preset's own setting is the preset's run (no override), shared with bench/science.py's.
    own = load_config(preset, []).agent.max_actions_per_turn
    return [(f"{n} action(s)/turn", [] if n == own else [f"agent.max_actions_per_turn={n}"]) for n in args.actions]


def per_seed(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    return " / ".join(format(r[key], fmt) for r in runs)


def table(finding: str, preset: str, results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        f"**{finding}** on `{preset}` (held-out success before -> after RL per seed; detector = first "
        "Echo-Trap firing (rules); drop = first iteration with rollout success < half of iteration 0's)",
        "",
        "| arm | random / ceiling | before | after (per seed) | mean after | z per seed | detector | drop "
        "| entropy end/start | in-group std end/start | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        detector = " / ".join("never" if r["fired"] is None else f"{r['fired']} ({','.join(r['rules'])})" for r in runs)
        drop = " / ".join("never" if r["drop"] is None else str(r["drop"]) for r in runs)
        lines.append(
            f"| {label} | {runs[0]['random']:.3f} / {runs[0]['ceiling']:.3f} "
            f"| {statistics.fmean(r['before'] for r in runs):.3f} | {per_seed(runs, 'after', '.3f')} "
            f"| {statistics.fmean(r['after'] for r in runs):.3f} | {per_seed(runs, 'z', '+.1f')} | {detector} "
            f"| {drop} | {per_seed(runs, 'entropy_ratio', '.2f')} "
            f"| {per_seed(runs, 'std_ratio', '.2f')} | {per_seed(runs, 'wall_min', '.1f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("finding", choices=["collapse", "freshness", "granularity"])
    parser.add_argument("--presets", nargs="+", default=["bandit", "frozenlake"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, default=5, help="freshness: K of Online-K")
    parser.add_argument("--actions", nargs="+", type=int, default=[1, 2, 3, 5], help="granularity: actions per turn")
    parser.add_argument("--store", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=None, help="append the tables to this file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra override for every run")
    parser.add_argument(
        "--arms", nargs="+", default=None, help="run only these arms, by label (e.g. 'StarPO-S' 'vanilla GRPO')"
    )
    args = parser.parse_args()

    for preset in args.presets:
        results: dict[str, list[dict[str, Any]]] = {}
        arms = variants(args.finding, preset, args)
        unknown = sorted(set(args.arms or []) - {label for label, _ in arms})
        if unknown:
            parser.error(f"--arms {unknown}: {args.finding} has the arms {[label for label, _ in arms]}")
        for label, overrides in arms:
            if args.arms is not None and label not in args.arms:
                continue
            # The preset's own arm is the same command as bench/science.py's run: share it.
            tag = "science" if not overrides else re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
            for seed in args.seeds:
                summary, wall, _cpu = train(preset, seed, args.store, [*overrides, *args.overrides], tag=tag)
                results.setdefault(label, []).append(measured(summary, args.store, wall))
                print(json.dumps(results[label][-1]), flush=True)
        text = table(args.finding, preset, results)
        print(text, flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(text + "\n\n")


if __name__ == "__main__":
    main()
