"""Paired A/B of the HF engine: another checkout's ``hf_engine.py`` vs this one, in one process.

Both engines run on the same model and prompts, interleaved (A B, B A, ...), so each pair sees one
host state: on a shared host the median of the per-pair ratios is steadier than comparing two
separate runs of ``bench/rollout.py``. The old file is loaded as a module of its own and must work
with this checkout's other modules (``models/fast_qwen2.py`` etc.).

    git archive <commit> | tar -x -C /tmp/before
    HF_HUB_OFFLINE=1 .venv/bin/python bench/engine_ab.py --old /tmp/before [--batches 32 128] [--pairs 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
from rollout import make_prompts, run_engine  # bench/rollout.py (this folder is sys.path[0])

from ragen_tasks.models import load_policy
from ragen_tasks.rollout.hf_engine import HFEngine


def load_old_engine(checkout: Path) -> type:
    path = checkout / "ragen_tasks" / "rollout" / "hf_engine.py"
    spec = importlib.util.spec_from_file_location("old_hf_engine", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no hf_engine.py at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_hf_engine"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module.HFEngine  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="root of the other checkout (e.g. from git archive)")
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old_cls = load_old_engine(args.old)
    model, tok = load_policy("tiny")
    print(f"torch threads={torch.get_num_threads()}  new_tokens={args.new_tokens}  pairs={args.pairs}")
    print("| batch | old tok/s (best, median) | new tok/s (best, median) | new/old (median of pairs) |")
    print("|---|---|---|---|")
    for batch in args.batches:
        prompts = make_prompts(tok, batch)
        engines = {"old": old_cls(model, tok), "new": HFEngine(model, tok)}
        for engine in engines.values():
            run_engine(engine, prompts, 8, 0)  # warm-up
        rates: dict[str, list[float]] = {"old": [], "new": []}
        for seed in range(args.pairs):
            order = ("old", "new") if seed % 2 == 0 else ("new", "old")
            for name in order:
                n, dt = run_engine(engines[name], prompts, args.new_tokens, seed)
                rates[name].append(n / dt)
        ratio = statistics.median(a / b for a, b in zip(rates["new"], rates["old"], strict=True))
        old, new = rates["old"], rates["new"]
        print(
            f"| {batch} | {max(old):,.0f}, {statistics.median(old):,.0f} | {max(new):,.0f}, "
            f"{statistics.median(new):,.0f} | {ratio:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
