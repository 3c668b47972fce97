"""Key safety: traversal, absolute paths and odd run ids are refused before any I/O (fuzzed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_tasks.data.keys import UnsafeKeyError, check_relative_key, checkpoint_key, manifest_key
from ragen_tasks.data.store import Store

SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@pytest.mark.parametrize(
    "run_id",
    [
        "..",
        "../x",
        "a/../../etc",
        "/abs",
        "a/b",
        "a\\b",
        "",
        " ",
        ".hidden",
        "a..b",
        "x" * 129,
        "é",
        "a\x00b",
        "-lead",
        "run id",
        None,
        3,
    ],
)
def test_bad_run_ids_refused(run_id: object) -> None:
    with pytest.raises(UnsafeKeyError, match="run_id"):
        manifest_key(run_id, 0, "rollouts", "trajectories")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        ("run", -1, "batch"),
        ("run", 10**6, "batch"),
        ("run", True, "batch"),
        ("run", 0, "../batch"),
        ("run", 0, "weights"),
    ],
)
def test_bad_iteration_and_stage_refused(bad: tuple[object, object, object]) -> None:
    with pytest.raises(UnsafeKeyError):
        manifest_key(*bad, "trajectories")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_fuzz_run_ids_only_safe_parts_pass(run_id: str) -> None:
    try:
        key = manifest_key(run_id, 1, "batch", "trajectories")
    except UnsafeKeyError:
        assert not SAFE.fullmatch(run_id) or ".." in run_id
        return
    assert SAFE.fullmatch(run_id) and ".." not in run_id
    assert key.startswith(f"{run_id}/iter_000001/batch/") and not key.startswith("/")
    assert all(part not in ("", ".", "..") for part in key.split("/"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["..", ".", "", "a", "/", "b..", "ok_1", "\\", "~"]), min_size=1, max_size=5))
def test_fuzz_relative_keys(parts: list[str]) -> None:
    key = "/".join(parts)
    try:
        check_relative_key(key)
    except UnsafeKeyError:
        return
    assert not key.startswith("/") and all(SAFE.fullmatch(p) and ".." not in p for p in key.split("/"))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["../../etc", "/etc/passwd", "a/../b", "..", "x/./y"]))
def test_store_refuses_before_any_io(tmp_path_factory: pytest.TempPathFactory, run_id: str) -> None:
    root = tmp_path_factory.mktemp("s")
    store = Store(str(root))
    with pytest.raises(UnsafeKeyError):
        store.write_json(run_id, 0, "tasks", "tasks", [1], producer="t")
    with pytest.raises(UnsafeKeyError):
        store.upload_dir(root, f"{run_id}/checkpoints/step_000001")
    assert list(Path(root).iterdir()) == []  # nothing was created


def test_store_root_with_traversal_refused() -> None:
    with pytest.raises(UnsafeKeyError):
        Store("s3://bucket/../other")
    with pytest.raises(ValueError, match="protocol"):
        Store("gcs://bucket")


def test_checkpoint_key_layout() -> None:
    assert checkpoint_key("run-1", 7) == "run-1/checkpoints/step_000007"


def test_worker_items_and_iteration_folders_round_trip() -> None:
    from ragen_tasks.data.keys import iteration_folder, parse_iteration_folder, parse_worker_item, worker_item

    assert worker_item("pod-7.a", 12) == "w-pod-7.a-000012"
    assert parse_worker_item("w-pod-7.a-000012") == ("pod-7.a", 12)
    assert parse_worker_item("trajectories") is None and parse_worker_item("w-a-12") is None
    for bad_seq in (-1, 1_000_000, True, "3"):
        with pytest.raises(ValueError, match="seq="):
            worker_item("a", bad_seq)  # type: ignore[arg-type]
    with pytest.raises(UnsafeKeyError):
        worker_item("../a", 0)
    assert iteration_folder(7) == "iter_000007" and parse_iteration_folder("iter_000007") == 7
    assert parse_iteration_folder("iter_7") is None and parse_iteration_folder("checkpoints") is None
