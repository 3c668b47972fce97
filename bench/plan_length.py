"""Sokoban success by each room's shortest solution: where evaluations win and lose rooms.

Reads evaluation records of one Sokoban config on the same seeds, either ``ragen evaluate --json``
output or the ``bench-eval-*.json`` files ``bench/science.py`` keeps beside a run, solves every seed's
room with the game's BFS solver (``SokobanEnv.solve``) and prints a markdown table: per shortest-plan
length, the number of rooms and each record's success rate on them.

Usage::

    python bench/plan_length.py LABEL=RECORD.json [LABEL=RECORD.json ...] [--longest 9]

Rooms whose shortest plan is longer than ``--longest`` (or that the solver finds none for) share the
last row.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def outcomes(record: dict[str, Any], path: Path) -> dict[int, bool]:
    """seed -> success of a record's Sokoban episodes (``per_seed`` is a list in ``bench-eval-*`` files,
    ``{env: list}`` in ``ragen evaluate --json`` records)."""
    per_seed = record.get("per_seed")
    if isinstance(per_seed, dict):
        per_seed = per_seed.get("sokoban")
    if not isinstance(per_seed, list):
        raise SystemExit(f"{path}: no per-seed Sokoban outcomes (evaluate with `ragen evaluate --json`)")
    return {int(o["seed"]): bool(o["success"]) for o in per_seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", metavar="LABEL=RECORD.json")
    parser.add_argument("--longest", type=int, default=9, help="rows per length up to this; longer ones share a row")
    args = parser.parse_args()

    from ragen_tasks.envs import make

    labelled: dict[str, dict[int, bool]] = {}
    for item in args.records:
        label, sep, name = item.partition("=")
        if not sep or not label or not name:
            raise SystemExit(f"{item!r}: expected LABEL=RECORD.json")
        path = Path(name)
        labelled[label] = outcomes(json.loads(path.read_text()), path)
    seed_sets = {label: set(o) for label, o in labelled.items()}
    seeds = sorted(set.intersection(*seed_sets.values()))
    if not seeds:
        raise SystemExit("the records share no seed: evaluate them on the same seeds")

    env = make("sokoban")
    rows: dict[str, list[int]] = defaultdict(list)  # length row -> seeds
    for seed in seeds:
        env.reset(seed=seed)
        plan = env.solve()  # type: ignore[attr-defined]
        length = None if plan is None else len(plan)
        rows[str(length) if length is not None and length <= args.longest else f"> {args.longest}"].append(seed)

    print(f"Success by shortest plan on {len(seeds)} shared seeds ({seeds[0]}..{seeds[-1]}).\n")
    print("| shortest plan (actions) | rooms | " + " | ".join(labelled) + " |")
    print("|---|---|" + "---|" * len(labelled))
    for row in sorted(rows, key=lambda r: (r.startswith(">"), int(r.lstrip("> ")))):
        rates = [sum(labelled[label][s] for s in rows[row]) / len(rows[row]) for label in labelled]
        print(f"| {row} | {len(rows[row])} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
