"""The paper's games at CPU scale: per game, SFT-only vs SFT+RL beside random play and the ceiling.

For each game preset and seed this trains through the real CLI (``ragen train PRESET --set seed=S``,
warm start included, wall time measured), then evaluates on held-out seeds that neither training
nor the presets' tuning ever used (``--eval-offset``, default 2,000,000; training seeds stay below
1,000,000 and the runs' own evaluation starts at 1,000,000):

* SFT-only: the run's warm-started policy (checkpoint 0 of its ``warm-start-<key>`` cache run) —
  the same warm start, no RL, as the paper's SFT baseline;
* SFT+RL: the run's final checkpoint;
* random play and the ceiling at the agent's budget, on the same seeds
  (``ragen_tasks.evaluation.reference_points``);
* RL's gain: the one-sided two-proportion z of SFT+RL over SFT-only, per seed and pooled (all RL runs
  against each distinct SFT-only policy once: runs from one cached warm start share its evaluation);
  and, as both play the same held-out seeds, the paired exact McNemar p per seed (one-sided: the rooms
  only SFT+RL solves against those only SFT-only solves; ``evaluation.pair_outcomes``).

Evaluation samples at each of ``--temperatures``: 0.5 is the paper's validation setting (and the
game presets'), 1.0 the policy RL trains, 0 greedy decoding. Greedy is there to tell learning from
sharpening: sampling at a lower temperature also removes the random moves of noisy demonstrations,
so a gain at 0.5 or 1 that greedy SFT-only already matches is RL committing to the warm start's own
best moves, not finding better ones. Prints one markdown table (and writes it with ``--out``) for
``bench/RESULTS.md``.

Usage::

    python bench/science.py [--presets sokoban frozenlake bandit] [--seeds 0 1 2]
                            [--eval-seeds 512] [--eval-offset 2000000] [--temperatures 0.5 1.0 0]
                            [--store DIR] [--out FILE] [--set key=value ...] [--runs RUN_DIR ...]

``--seeds`` with no value trains nothing and tabulates only the ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Beside a run this benchmark made: "<wall> wall_s <cpu> cpu_s" (older runs: the wall time only).
TIMES = "bench-wall-s.txt"


def kept_times(run_dir: Path) -> tuple[float, float]:
    """(wall, CPU) seconds this benchmark kept beside ``run_dir`` (nan where it kept none)."""
    path = run_dir / TIMES
    times = path.read_text().split() if path.exists() else []
    return (float(times[0]) if times else math.nan), (float(times[2]) if len(times) > 2 else math.nan)


def train(
    preset: str, seed: int, store: Path, overrides: list[str], *, tag: str = "science"
) -> tuple[dict[str, Any], float, float]:
    """Run ``ragen train`` as a user would; return (summary.json, wall seconds, CPU seconds). A run
    that already finished in ``store`` (same run id, same settings) is read back with the times it took then.

    Beside the wall time, the run's CPU seconds (its process tree's user + system time) are printed
    and kept: with ``OMP_NUM_THREADS=1`` they are the run's wall time on an otherwise idle core,
    a measure that stays honest when other work shares the machine."""
    run_id = f"{tag}-{Path(preset).stem}-s{seed}"
    summary_path, wall_path = store / run_id / "summary.json", store / run_id / TIMES
    settings = [f"seed={seed}", *overrides]
    if summary_path.exists() and wall_path.exists():
        check_same_settings(store / run_id, preset, settings)
        return json.loads(summary_path.read_text()), *kept_times(store / run_id)
    ragen = str(Path(sys.executable).parent / "ragen")  # the console script installed beside this Python
    command = [ragen, "train", preset, "--run-id", run_id, "--store", str(store)]
    command += [item for setting in settings for item in ("--set", setting)]
    print("$", " ".join(command), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{run_id}: wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min", flush=True)
    wall_path.write_text(f"{wall:.1f} wall_s {cpu:.1f} cpu_s\n")
    return json.loads(summary_path.read_text()), wall, cpu


def check_same_settings(run_dir: Path, preset: str, settings: list[str]) -> None:
    """Refuse to read back a finished run made with other settings than ``preset`` + ``settings``
    (the store it was written to aside): a table would silently mix in someone else's run."""
    from ragen_tasks import pipeline
    from ragen_tasks.presets import load_config

    made = pipeline.open_existing_run(str(run_dir)).config.model_dump(mode="json")
    wanted = load_config(preset, settings).model_dump(mode="json")
    differences = pipeline.config_differences(made, wanted, free=("store",))
    if differences:
        raise SystemExit(
            f"{run_dir} was made with other settings than {preset} --set {' --set '.join(settings)} (they "
            f"differ in {pipeline.describe_differences(differences, current='asked for')}): pass the run's --set values, or use another --store"
        )


def evaluation(checkpoint: Path, env: str, seeds: int, offset: int, temperature: float) -> dict[str, Any]:
    """Held-out evaluation of ``checkpoint`` on ``env`` (the config of the run that made it), sampled
    at ``temperature``: the env's metrics (``success``, ...) and ``per_seed`` outcomes. Kept beside the
    run (``bench-eval-*.json``), so rerunning the table (e.g. with more runs) evaluates only what is new."""
    from ragen_tasks import pipeline
    from ragen_tasks.evaluation import per_seed_outcomes

    run = pipeline.run_of_checkpoint(checkpoint)
    if run is None:
        raise SystemExit(f"{checkpoint} is not inside a run folder")
    kept = checkpoint.parents[1] / f"bench-eval-{checkpoint.name}-{env}-T{temperature:g}-{offset}-{seeds}.json"
    if kept.exists():
        record: dict[str, Any] = json.loads(kept.read_text())
        if "per_seed" in record:  # older versions of this benchmark kept the metrics only: those evaluate again
            return record
    per_env, trajectories = pipeline.evaluate_checkpoint(
        run.config, checkpoint, seeds=seeds, seed_offset=offset, env_names=[env], temperature=temperature
    )
    record = {**per_env[env], "per_seed": per_seed_outcomes(trajectories)[env]}
    kept.write_text(json.dumps(record) + "\n")
    return record


def joined(values: list[float], fmt: str) -> str:
    """``values`` formatted and joined by " / "; "-" for an unknown (nan) one, e.g. the time of a run
    this benchmark did not start."""
    return " / ".join("-" if math.isnan(v) else format(v, fmt) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["sokoban", "frozenlake", "bandit"])
    parser.add_argument(
        "--seeds", nargs="*", type=int, default=[0, 1, 2], help="training seeds to run (none: only the --runs)"
    )
    parser.add_argument("--eval-seeds", type=int, default=512)
    parser.add_argument("--eval-offset", type=int, default=2_000_000)
    parser.add_argument(
        "--temperatures",
        nargs="+",
        type=float,
        default=[0.5, 1.0, 0.0],
        help="evaluation temperatures (0.5: the paper's; 1: the policy RL trains; 0: greedy)",
    )
    parser.add_argument("--store", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--runs",
        nargs="+",
        type=Path,
        default=[],
        help="finished runs (folders) to add as further seeds of the preset for their game",
    )
    args = parser.parse_args()
    for folder in args.runs:  # checked before any preset's training or evaluation starts
        if not (folder / "summary.json").is_file():
            parser.error(
                f"--runs {folder}: no summary.json there; give the folder of a finished run "
                "(a run writes summary.json when its last iteration is done)"
            )

    from ragen_tasks.evaluation import one_sided_z, pair_outcomes, reference_points
    from ragen_tasks.presets import load_config

    rows = []
    for preset in args.presets:
        config = load_config(preset, args.overrides)
        env = config.envs[0].name
        reference = reference_points(config.envs[0], config.agent, seeds=args.eval_seeds, seed_offset=args.eval_offset)
        added, added_labels = [], []
        for folder in args.runs:  # finished runs of this preset made elsewhere, as further seeds
            summary = json.loads((folder / "summary.json").read_text())
            if env not in summary["eval_after_rl"]:  # a run of another game's preset
                continue
            if "cache_run" not in summary.get("warm_start", {}):  # checked before any training
                raise SystemExit(
                    f"--runs {folder}: the run has no cached warm start (it started from a model folder), so "
                    "there is no SFT-only policy to compare it with"
                )
            added.append((summary, *kept_times(folder)))
            added_labels.append(folder.name)
        if not args.seeds and not added:
            raise SystemExit(f"{preset}: nothing to tabulate: give --seeds to train, or --runs of its game ({env})")
        runs = [train(preset, seed, args.store, args.overrides) for seed in args.seeds] + added
        labels = [str(seed) for seed in args.seeds] + added_labels
        for temperature in args.temperatures:
            sft, rl, zs, paired_ps = [], [], [], []
            sft_by_policy: dict[Path, float] = {}  # each distinct SFT-only policy once: runs may share a warm start
            for seed, (summary, wall, _cpu) in zip(labels, runs, strict=True):
                final = Path(summary["final_checkpoint"])  # <store>/<run>/checkpoints/step_N
                cache = final.parents[2] / summary["warm_start"]["cache_run"] / "checkpoints" / "step_000000"
                before = evaluation(cache, env, args.eval_seeds, args.eval_offset, temperature)
                after = evaluation(final, env, args.eval_seeds, args.eval_offset, temperature)
                sft.append(float(before["success"]))
                sft_by_policy[cache.resolve()] = sft[-1]
                rl.append(float(after["success"]))
                zs.append(one_sided_z(sft[-1], args.eval_seeds, rl[-1], args.eval_seeds))
                pair = pair_outcomes(before["per_seed"], after["per_seed"], env, names=("SFT-only", "SFT+RL"))
                paired_ps.append(pair.p_second_better())
                print(
                    f"{preset} seed {seed} T={temperature}: SFT-only {sft[-1]:.3f}  SFT+RL {rl[-1]:.3f}  "
                    f"z {zs[-1]:+.2f}  paired: {pair.second_only} rooms won, {pair.first_only} lost, "
                    f"p {paired_ps[-1]:.2g}  wall {joined([wall / 60], '.1f')} min",
                    flush=True,
                )
            # Pooled: every RL run's episodes against every distinct SFT-only policy's. Runs that share
            # one warm start share its evaluation too (the same checkpoint on the same seeds), which
            # counts once, not once per run.
            pooled_z = one_sided_z(
                statistics.fmean(sft_by_policy.values()),
                args.eval_seeds * len(sft_by_policy),
                statistics.fmean(rl),
                args.eval_seeds * len(runs),
            )
            ceiling = "-" if reference["ceiling"] is None else f"{reference['ceiling']:.3f}"
            rows.append(
                f"| {preset} ({env}) | {temperature:g} | {joined(sft, '.3f')} | {joined(rl, '.3f')} "
                f"| {joined(zs, '+.1f')} (pooled {pooled_z:+.1f}) | {joined(paired_ps, '.2g')} "
                f"| {reference['random']:.3f} | {ceiling} "
                f"| {joined([wall / 60 for _, wall, _ in runs], '.1f')} | {joined([cpu / 60 for *_, cpu in runs], '.1f')} |"
            )
    table = "\n".join(
        [
            f"Held-out success on {args.eval_seeds} seeds from {args.eval_offset} per run; "
            + " and ".join(
                ([f"training seeds {args.seeds}"] if args.seeds else [])
                + ([f"the runs {', '.join(p.name for p in args.runs)}"] if args.runs else [])
            )
            + ".",
            "",
            "| preset (game) | eval T | SFT-only | SFT+RL | z (RL over SFT) | paired p (RL over SFT) | random | ceiling "
            "| wall (min) | CPU (min) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
