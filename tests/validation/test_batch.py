"""Great Expectations batch validation: a bad batch is named, quarantined and never returned."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import time
from pathlib import Path

import pyarrow as pa
import pytest

from ragen_tasks.data.manifest import ManifestError
from ragen_tasks.data.store import Store
from ragen_tasks.data.trajectory import to_table
from ragen_tasks.validation.batch import (
    BatchLimits,
    BatchValidationError,
    build_suite,
    validate_stored_batch,
    validate_table,
)

_spec = importlib.util.spec_from_file_location("_data_factory", Path(__file__).parents[1] / "data" / "_factory.py")
assert _spec is not None and _spec.loader is not None
factory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(factory)

LIMITS = BatchLimits(reward_min=-5.0, reward_max=5.0, max_tokens=4096, max_turns=5)
W = {"producer": "test", "policy_version": 3, "weights_fingerprint": "f" * 64}


def _validate(trajs: list) -> list[str]:  # type: ignore[type-arg]
    return validate_table(to_table(trajs), limits=LIMITS, policy_version=3, weights_fingerprint="f" * 64).failed


def test_good_batch_passes() -> None:
    assert _validate(factory.make_batch(16)) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda t: dataclasses.replace(t, reward=math.nan),
            "expect_column_values_to_be_in_set(row_problems: reward_not_finite)",
        ),
        (
            lambda t: dataclasses.replace(t, turn_rewards=[math.inf, 0.0]),
            "expect_column_values_to_be_in_set(row_problems: reward_not_finite)",
        ),
        (lambda t: dataclasses.replace(t, reward=50.0), "expect_column_values_to_be_between(reward)"),
        (
            lambda t: dataclasses.replace(t, loss_mask=[0] * t.num_tokens),
            "expect_column_values_to_be_between(policy_loss_tokens)",
        ),
        (lambda t: dataclasses.replace(t, policy_version=2), "expect_column_values_to_be_in_set(policy_version)"),
        (
            lambda t: dataclasses.replace(t, weights_fingerprint="0" * 64),
            "expect_column_values_to_be_in_set(weights_fingerprint)",
        ),
        (
            lambda t: dataclasses.replace(t, loss_mask=[1, *t.loss_mask[1:]]),
            "expect_column_values_to_be_in_set(row_problems: masks_malformed)",
        ),
        (
            lambda t: dataclasses.replace(t, rollout_logprobs=t.rollout_logprobs[:-1]),
            "expect_column_values_to_be_in_set(row_problems: lists_misaligned)",
        ),
        (
            lambda t: dataclasses.replace(t, rollout_logprobs=[math.nan, *t.rollout_logprobs[1:]]),
            "expect_column_values_to_be_in_set(row_problems: logprobs_not_finite)",
        ),
        (lambda t: dataclasses.replace(t, status="exploded"), "expect_column_values_to_be_in_set(status)"),
        (lambda t: dataclasses.replace(t, traj_id="t00000"), "expect_column_values_to_be_unique(traj_id)"),
    ],
)
def test_each_failure_is_named(change, expected: str) -> None:  # type: ignore[no-untyped-def]
    batch = factory.make_batch(8)
    batch[3] = change(batch[3])
    failed = _validate(batch)
    assert expected in failed, failed


def test_row_problems_name_every_problem_of_every_row() -> None:
    batch = factory.make_batch(8)
    batch[1] = dataclasses.replace(batch[1], reward=math.inf, loss_mask=[1, *batch[1].loss_mask[1:]])
    batch[5] = dataclasses.replace(batch[5], turn_starts=[*batch[5].turn_starts, 0])
    failed = _validate(batch)
    assert "expect_column_values_to_be_in_set(row_problems: lists_misaligned, masks_malformed, reward_not_finite)" in (
        failed
    )


def test_versions_are_suite_parameters_of_one_cached_suite() -> None:
    """The suite is built once per limits; each validation checks against the manifest it is given."""
    assert build_suite(LIMITS) is build_suite(LIMITS)
    batch4 = [dataclasses.replace(t, policy_version=4) for t in factory.make_batch(4)]
    table = to_table(batch4)
    assert validate_table(table, limits=LIMITS, policy_version=4, weights_fingerprint="f" * 64).success
    failed = validate_table(table, limits=LIMITS, policy_version=3, weights_fingerprint="f" * 64).failed
    assert failed == ["expect_column_values_to_be_in_set(policy_version)"]
    failed = validate_table(table, limits=LIMITS, policy_version=4, weights_fingerprint="e" * 64).failed
    assert failed == ["expect_column_values_to_be_in_set(weights_fingerprint)"]


def test_length_limits() -> None:
    limits = BatchLimits(reward_min=-5, reward_max=5, max_tokens=39, max_turns=1)
    failed = validate_table(
        to_table(factory.make_batch(4)), limits=limits, policy_version=3, weights_fingerprint="f" * 64
    ).failed
    assert "expect_column_values_to_be_between(num_tokens)" in failed
    assert "expect_column_values_to_be_between(num_turns)" in failed


def test_schema_problems_named() -> None:
    table = to_table(factory.make_batch(4))
    table = table.drop_columns(["loss_mask"]).append_column("extra", pa.array([1, 2, 3, 4]))
    outcome = validate_table(table, limits=LIMITS, policy_version=3, weights_fingerprint="f" * 64)
    assert "expect_table_columns_to_match_set" in outcome.failed
    assert "loss_mask: missing" in outcome.result["schema_problems"]
    assert "extra: unexpected column" in outcome.result["schema_problems"]


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_failing_batch_is_quarantined(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    root = str(tmp_path)
    if backend == "s3":
        import boto3

        boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server")).create_bucket(Bucket="quarantine-test")
        root = "s3://quarantine-test/runs"
    store = Store(root)
    batch = factory.make_batch(8)
    batch[0] = dataclasses.replace(batch[0], reward=math.nan)
    batch[1] = dataclasses.replace(batch[1], loss_mask=[0] * batch[1].num_tokens)
    batch[2] = dataclasses.replace(batch[2], policy_version=9)
    manifest = store.write_trajectories("run1", 4, "batch", batch, **W)
    with pytest.raises(BatchValidationError) as err:
        validate_stored_batch(store, "run1", 4, "batch", limits=LIMITS)
    msg = str(err.value)
    for name in ("reward_not_finite", "policy_loss_tokens", "policy_version"):
        assert name in msg
    assert err.value.quarantine_uri and "run1/quarantine/iter_000004/batch" in err.value.quarantine_uri
    assert not store.has_manifest("run1", 4, "batch")  # no longer committed: never trained on
    with pytest.raises(ManifestError):
        store.read_trajectories("run1", 4, "batch")
    q = f"{store._root}/run1/quarantine/iter_000004/batch/q-000001"
    result = json.loads(store.fs.cat_file(f"{q}/trajectories.validation.json"))
    assert set(err.value.failed) == set(result["failed"]) and result["gx"]["success"] is False
    assert store.fs.exists(f"{q}/{manifest.objects[0].name}") and store.fs.exists(f"{q}/trajectories.manifest.json")
    assert not store.fs.exists(f"{store._root}/run1/iter_000004/batch/{manifest.objects[0].name}")

    # The same iteration quarantined again (a re-produced batch that fails again) keeps the first record.
    store.write_trajectories("run1", 4, "batch", batch[:4], **W)
    with pytest.raises(BatchValidationError) as again:
        validate_stored_batch(store, "run1", 4, "batch", limits=LIMITS)
    assert again.value.quarantine_uri and again.value.quarantine_uri.endswith("q-000002")
    assert json.loads(store.fs.cat_file(f"{q}/trajectories.validation.json")) == result


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_unreadable_committed_batch_is_quarantined(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A committed batch whose bytes are not Parquet (a hostile or broken writer re-signed its manifest)
    is quarantined like a failed validation, so the stage that produces it can run again."""
    root = str(tmp_path)
    if backend == "s3":
        import boto3

        boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server")).create_bucket(Bucket="unreadable")
        root = "s3://unreadable/runs"
    store = Store(root)
    manifest = store.write_trajectories("run1", 2, "rollouts", factory.make_batch(4), **W)
    garbage = b"not parquet at all" * 10
    name = manifest.objects[0].name
    prefix = f"{store._root}/run1/iter_000002/rollouts"
    store.fs.pipe_file(f"{prefix}/{name}", garbage)
    entry = dataclasses.replace(manifest.objects[0], sha256=hashlib.sha256(garbage).hexdigest(), size=len(garbage))
    resigned = dataclasses.replace(manifest, objects=(entry,))
    store.fs.pipe_file(f"{prefix}/trajectories.manifest.json", resigned.to_json_bytes())
    with pytest.raises(BatchValidationError, match="could not be read") as err:
        validate_stored_batch(store, "run1", 2, "rollouts", limits=LIMITS)
    assert err.value.quarantine_uri and err.value.quarantine_uri.endswith("rollouts/q-000001")
    assert not store.has_manifest("run1", 2, "rollouts")  # a rerun of the rollout stage produces it again
    store.write_trajectories("run1", 2, "rollouts", factory.make_batch(4), **W)
    assert len(validate_stored_batch(store, "run1", 2, "rollouts", limits=LIMITS)[0]) == 4


def test_passing_batch_is_returned(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.write_trajectories("run1", 0, "batch", factory.make_batch(8), **W)
    got, manifest = validate_stored_batch(store, "run1", 0, "batch", limits=LIMITS)
    assert len(got) == 8 and manifest.policy_version == 3


def test_bad_limits_named() -> None:
    with pytest.raises(ValueError, match="reward bounds"):
        BatchLimits(reward_min=1, reward_max=0, max_tokens=1, max_turns=1)


def test_gx_validation_of_128_trajectories_is_fast() -> None:
    """Design target: <= 100 ms after import on a quiet machine; asserted loosely (shared CI cores)."""
    table = to_table(factory.make_batch(128, tokens=2000, turns=5))
    validate_table(table, limits=LIMITS, policy_version=3, weights_fingerprint="f" * 64)  # warm the GX context
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        outcome = validate_table(table, limits=LIMITS, policy_version=3, weights_fingerprint="f" * 64)
        times.append(time.perf_counter() - t0)
    assert outcome.success
    assert min(times) < 0.5, times
