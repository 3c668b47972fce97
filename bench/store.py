"""Benchmark the data plane: write + commit + read + GX validate + freshness for one rollout batch.

A batch of 128 trajectories of ~2k tokens (5 turns) is written to and read back from a ``file://``
store and from ``s3://`` on moto's server bound to 127.0.0.1 (a real S3 API over loopback HTTP).
Prints median times over ``--repeats`` runs and the S3/file ratio. GX is imported and warmed up
before timing ("after import"). Usage::

    .venv/bin/python bench/store.py [--trajectories 128] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import statistics
import tempfile
import time
import uuid

from ragen_tasks.data.freshness import freshness_report
from ragen_tasks.data.store import Store
from ragen_tasks.data.synthetic import trajectory, turn_layout
from ragen_tasks.data.trajectory import Trajectory, to_table
from ragen_tasks.validation.batch import BatchLimits, build_suite, validate_table

FP = "f" * 64


def make_batch(n: int, tokens: int, turns: int = 5, prompt: int = 200) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    mask, starts, ends = turn_layout(tokens, prompt, turns)
    for i in range(n):
        rewards = [-0.1] * (turns - 1) + [1.0]
        out.append(
            trajectory(
                [rng.randrange(150_000) for _ in range(tokens)],
                mask,
                starts,
                ends,
                rewards,
                prompt_length=prompt,
                traj_id=f"t{i:05d}",
                env_name="sokoban",
                seed=i,
                group_id=i // 8,
                policy_version=3,
                weights_fingerprint=FP,
                rollout_logprobs=[-rng.random() * m for m in mask],
                turn_actions=[["Up", "Left"]] * turns,
                turn_think=["push the box left"] * turns,
                turn_responses=["<think>push the box left</think><answer>Up || Left</answer>"] * turns,
                turn_observations=["######\n#_P__#\n#_X__#\n#__O_#\n######"] * turns,
                success=True,
            )
        )
    return out


def bench_root(root: str, batch: list[Trajectory], repeats: int) -> dict[str, float]:
    store = Store(root)
    limits = BatchLimits(reward_min=-50, reward_max=50, max_tokens=4096, max_turns=5)
    times: dict[str, list[float]] = {"write+commit": [], "read": [], "gx_validate": [], "freshness": []}
    for r in range(repeats):
        t0 = time.perf_counter()
        store.write_trajectories(
            f"bench{r}", 0, "rollouts", batch, producer="bench", policy_version=3, weights_fingerprint=FP
        )
        t1 = time.perf_counter()
        table, manifest = store.read_table(f"bench{r}", 0, "rollouts")
        t2 = time.perf_counter()
        outcome = validate_table(
            table,
            limits=limits,
            policy_version=manifest.policy_version,
            weights_fingerprint=manifest.weights_fingerprint,
        )
        t3 = time.perf_counter()
        assert outcome.success, outcome.failed
        report = freshness_report(batch, 3, {3: FP}, 0)
        t4 = time.perf_counter()
        assert len(report.accepted) == len(batch)
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["total"] = sum(med.values())
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trajectories", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import great_expectations  # noqa: F401  (import time reported separately)

    gx_import = time.perf_counter() - t0
    batch = make_batch(args.trajectories, args.tokens)
    t0 = time.perf_counter()
    validate_table(to_table(batch), limits=BatchLimits(-50, 50, 4096, 5), policy_version=3, weights_fingerprint=FP)
    gx_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    to_table(batch)
    convert = time.perf_counter() - t0

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
    )
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = {
                "file": bench_root(f"file://{tmp}", batch, args.repeats),
                "s3 (moto, loopback)": bench_root(f"s3://{bucket}/runs", batch, args.repeats),
            }
    finally:
        server.stop()

    size = len(to_table(batch).to_pylist()[0]["input_ids"])
    print(f"batch: {args.trajectories} trajectories x {size} tokens; median of {args.repeats}")
    print(
        f"great_expectations import: {gx_import * 1e3:.0f} ms; first validation (context build): {gx_first * 1e3:.0f} ms"
    )
    n_exp = len(build_suite(BatchLimits(-50, 50, 4096, 5)).expectations)
    print(f"GX suite: {n_exp} expectations on a flat {args.trajectories}-row frame")
    print(f"of write+commit, Trajectory list -> Arrow (trajectory.to_table): {convert * 1e3:.0f} ms")
    keys = list(next(iter(results.values())))
    print(f"{'backend':22s}" + "".join(f"{k:>14s}" for k in keys))
    for name, med in results.items():
        print(f"{name:22s}" + "".join(f"{med[k] * 1e3:12.1f}ms" for k in keys))
    f, s3 = results["file"], results["s3 (moto, loopback)"]
    print("ratio s3/file" + " " * 9 + "".join(f"{s3[k] / f[k]:13.2f}x" for k in keys))


if __name__ == "__main__":
    main()
