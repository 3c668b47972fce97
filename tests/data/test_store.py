"""Store round trips, commit protocol, crash/retry, races, tampering and key safety (file:// and s3://)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from ragen_tasks.data.manifest import ChecksumError, ManifestError
from ragen_tasks.data.store import DIR_MANIFEST, Store

_spec = importlib.util.spec_from_file_location("_data_factory", Path(__file__).with_name("_factory.py"))
assert _spec is not None and _spec.loader is not None
factory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(factory)

W = {"producer": "test", "policy_version": 3, "weights_fingerprint": "f" * 64}


def _stage_files(store: Store, run: str = "run1", it: int = 0, stage: str = "rollouts") -> list[str]:
    path = f"{store._root}/{run}/iter_{it:06d}/{stage}"
    if not store.fs.exists(path):
        return []
    return sorted(str(p).rsplit("/", 1)[-1] for p in store.fs.ls(path, detail=False))


def test_round_trip_identical_on_file_and_s3(tmp_path: Path, s3_bucket: str) -> None:
    batch = factory.make_batch(16)
    results = []
    for root in (f"file://{tmp_path}/store", str(tmp_path / "plain"), f"s3://{s3_bucket}/runs"):
        store = Store(root)
        written = store.write_trajectories("run1", 0, "rollouts", batch, **W, extra={"groups": 4})
        got, manifest = store.read_trajectories("run1", 0, "rollouts")
        assert manifest == written and manifest.num_rows == 16 and manifest.extra == {"groups": 4}
        results.append(got)
    assert results[0] == results[1] == results[2]
    # float32 log-probs: equal to the input after rounding to float32, everything else exact
    assert [t.input_ids for t in results[0]] == [t.input_ids for t in batch]
    assert [t.traj_id for t in results[0]] == [t.traj_id for t in batch]


def test_json_round_trip_and_idempotent_retry(store_root: str) -> None:
    store = Store(store_root)
    m1 = store.write_json("run1", 2, "eval", "results", {"success": 0.5, "seeds": [1, 2]}, producer="eval")
    m2 = store.write_json("run1", 2, "eval", "results", {"success": 0.9}, producer="other")  # retry: no rewrite
    assert m1 == m2
    obj, manifest = store.read_json("run1", 2, "eval", "results")
    assert obj == {"success": 0.5, "seeds": [1, 2]} and manifest.producer == "eval"
    assert store.has_manifest("run1", 2, "eval", "results")
    assert not store.has_manifest("run1", 3, "eval", "results")


def test_retry_returns_existing_manifest_without_rewriting(store_root: str) -> None:
    store = Store(store_root)
    first = store.write_trajectories("run1", 0, "rollouts", factory.make_batch(4), **W)
    before = _stage_files(store)
    second = store.write_trajectories(
        "run1", 0, "rollouts", factory.make_batch(6, seed=9), **{**W, "producer": "retry"}
    )
    assert second == first and _stage_files(store) == before
    assert len(store.read_trajectories("run1", 0, "rollouts")[0]) == 4


def test_missing_manifest_is_a_clear_error(store_root: str) -> None:
    store = Store(store_root)
    with pytest.raises(ManifestError, match="manifest is missing"):
        store.read_trajectories("run1", 0, "batch")


def test_last_committed_iteration(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    assert store.last_committed_iteration("run1", "batch") is None
    for k in range(3):
        store.write_trajectories("run1", k, "batch", factory.make_batch(2), **W)
    assert store.last_committed_iteration("run1", "batch") == 2


def test_tampered_object_fails_with_checksum_error(store_root: str) -> None:
    store = Store(store_root)
    manifest = store.write_trajectories("run1", 0, "rollouts", factory.make_batch(4), **W)
    path = f"{store._root}/run1/iter_000000/rollouts/{manifest.objects[0].name}"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        store.read_trajectories("run1", 0, "rollouts")


_CRASHING_WRITER = textwrap.dedent(
    """
    import os, signal, sys, importlib.util
    sys.path.insert(0, {tests!r})
    spec = importlib.util.spec_from_file_location("f", {factory!r}); f = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(f)
    from ragen_tasks.data import store as s
    die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "crash":  # die the moment the manifest would be written: data is uploaded, manifest not
        s.Store._commit = die
    if sys.argv[1] == "crash-writing":  # die with the data object's bytes written but not yet synced or named
        s.os.fsync = die
    seed = 0 if sys.argv[1] == "retry" else 1  # the retry's batch differs (a rollout is sampled again)
    s.Store({root!r}).write_trajectories("run1", 0, "rollouts", f.make_batch(8, seed=seed), producer="w",
                                         policy_version=3, weights_fingerprint="f" * 64)
    """
)


def _run_writer(tmp_path: Path, store_root: str, mode: str) -> int:
    here = Path(__file__).parent
    script = tmp_path / "writer.py"
    script.write_text(_CRASHING_WRITER.format(tests=str(here), factory=str(here / "_factory.py"), root=store_root))
    return subprocess.run([sys.executable, str(script), mode], env=os.environ.copy(), timeout=120).returncode


def test_writer_killed_between_data_and_manifest(store_root: str, tmp_path: Path) -> None:
    assert _run_writer(tmp_path, store_root, "crash") == -9
    store = Store(store_root)
    orphans = [f for f in _stage_files(store) if f.endswith(".parquet")]
    assert orphans, "data objects were uploaded before the kill"
    assert not store.has_manifest("run1", 0, "rollouts")
    with pytest.raises(ManifestError):
        store.read_trajectories("run1", 0, "rollouts")
    assert _run_writer(tmp_path, store_root, "retry") == 0
    manifest = store.read_manifest("run1", 0, "rollouts")
    # the killed attempt's object (other bytes, other name) went with the retry's commit: nothing orphaned
    assert _stage_files(store) == sorted([manifest.objects[0].name, "trajectories.manifest.json"])
    assert manifest.objects[0].name not in orphans
    assert [t.traj_id for t in store.read_trajectories("run1", 0, "rollouts")[0]] == [f"t{i:05d}" for i in range(8)]


_NAMELESS_FILES = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


@pytest.mark.skipif(not _NAMELESS_FILES, reason="no nameless files (O_TMPFILE) on this OS")
def test_writer_killed_while_writing_leaves_no_file(tmp_path: Path) -> None:
    """Locally the bytes are written to a file without a name: a kill before it is linked leaves nothing."""
    root = f"file://{tmp_path / 'store'}"
    assert _run_writer(tmp_path, root, "crash-writing") == -9
    assert _stage_files(Store(root)) == []


def test_a_damaged_object_is_replaced_by_the_next_attempt(store_root: str) -> None:
    """A data object already under the name an attempt would give its bytes is reused only if it holds
    those bytes; otherwise (damaged before any manifest named it) it is replaced."""
    store = Store(store_root)
    name = store.write_trajectories("probe", 0, "rollouts", factory.make_batch(4), **W).objects[0].name
    store._put_bytes(f"run1/iter_000000/rollouts/{name}", b"damaged")
    store.write_trajectories("run1", 0, "rollouts", factory.make_batch(4), **W)
    assert [t.traj_id for t in store.read_trajectories("run1", 0, "rollouts")[0]] == [f"t{i:05d}" for i in range(4)]


def test_commit_removes_only_its_own_items_orphans(store_root: str) -> None:
    store = Store(store_root)
    folder = "run1/iter_000000/rollouts"
    planted = {
        "trajectories-00000-0123456789abcdef.parquet": True,  # this item's, from an attempt killed before commit
        "trajectories-00001-0123456789abcdef.parquet": True,  # (another shard number)
        "w-a-000000-00000-0123456789abcdef.parquet": False,  # another item's (a worker still writing)
        "trajectories-x-00000-0123456789abcdef.parquet": False,  # item "trajectories-x"
        "trajectories-0123456789abcdef.json": False,  # a JSON item of the same name is another kind
    }
    for name in planted:
        store._put_bytes(f"{folder}/{name}", b"orphan")
    manifest = store.write_trajectories("run1", 0, "rollouts", factory.make_batch(4), **W)
    kept = sorted(n for n, doomed in planted.items() if not doomed)
    assert _stage_files(store) == sorted([*kept, manifest.objects[0].name, "trajectories.manifest.json"])
    store._put_bytes("run1/iter_000000/summary/summary-fedcba9876543210.json", b"{}")
    store._put_bytes("run1/iter_000000/summary/summary-x-fedcba9876543210.json", b"{}")
    summary = store.write_json("run1", 0, "summary", "summary", {"x": 1}, producer="test")
    assert _stage_files(store, stage="summary") == sorted(
        ["summary-x-fedcba9876543210.json", summary.objects[0].name, "summary.manifest.json"]
    )


@pytest.mark.parametrize(
    "way",
    [
        pytest.param("nameless", marks=pytest.mark.skipif(not _NAMELESS_FILES, reason="no O_TMPFILE")),
        "link refused",
        "named",
    ],
)
def test_local_writes_are_whole_and_create_only_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Every local write path (a nameless file where the OS has them; a named temp file where it has
    none, or refuses to link one): a replace replaces, a create-only write of a taken name returns
    False and changes nothing, and no temp file is left behind."""
    from ragen_tasks.data import local_files

    if way == "named":
        monkeypatch.setattr(local_files.os, "O_TMPFILE", None, raising=False)
        monkeypatch.delattr(local_files.os, "O_TMPFILE")
    if way == "link refused":  # e.g. a sandbox that forbids linking through /proc
        link = os.link

        def refuse_proc(source: str, *args: object, **kwargs: object) -> None:
            if str(source).startswith("/proc/"):
                raise PermissionError(1, "Operation not permitted", source)
            link(source, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(local_files.os, "link", refuse_proc)
    path = str(tmp_path / "a" / "x.json")
    assert local_files.write_local_file(path, b"one", exclusive=True)
    assert not local_files.write_local_file(path, b"two", exclusive=True)
    assert Path(path).read_bytes() == b"one"
    assert local_files.write_local_file(path, b"three", exclusive=False)
    assert Path(path).read_bytes() == b"three"
    assert os.listdir(tmp_path / "a") == ["x.json"]
    assert os.stat(path).st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("writers", [8])
def test_create_only_manifest_exactly_one_winner(store_root: str, writers: int) -> None:
    """Racing create-only writes of one key: exactly one succeeds (file: os.link/EEXIST; S3: If-None-Match)."""
    store = Store(store_root)
    barrier = threading.Barrier(writers)
    wins: list[int] = []

    def write(i: int) -> None:
        barrier.wait()
        if store._create_bytes("run1/iter_000000/batch/race.manifest.json", f"writer {i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.fs.cat_file(f"{store._root}/run1/iter_000000/batch/race.manifest.json") == f"writer {wins[0]}".encode()


def test_racing_batch_writers_agree_on_one_manifest(store_root: str) -> None:
    store = Store(store_root)
    barrier = threading.Barrier(4)
    out: dict[int, object] = {}

    def write(i: int) -> None:
        barrier.wait()
        out[i] = store.write_trajectories(
            "run1", 0, "batch", factory.make_batch(3, seed=i), **{**W, "producer": f"w{i}"}
        )

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = store.read_manifest("run1", 0, "batch")
    assert all(m == stored for m in out.values())  # every writer reports the one committed manifest
    winner = int(stored.producer[1:])
    got, _ = store.read_trajectories("run1", 0, "batch")  # the winner's bytes are intact (checksums pass)
    assert [t.input_ids for t in got] == [t.input_ids for t in factory.make_batch(3, seed=winner)]
    assert _stage_files(store, stage="batch") == [stored.objects[0].name, "trajectories.manifest.json"]  # losers' gone


def test_planted_pickle_is_never_loaded(store_root: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(sentinel), "w"))

    store = Store(store_root)
    manifest = store.write_trajectories("run1", 0, "rollouts", factory.make_batch(2), **W)
    stage = f"{store._root}/run1/iter_000000/rollouts"
    payload = pickle.dumps(Evil())
    store.fs.pipe_file(f"{stage}/trajectories-00001-evil.pkl", payload)  # planted beside the batch
    got, _ = store.read_trajectories("run1", 0, "rollouts")  # manifest-only: the pickle is not even read
    assert len(got) == 2
    # A manifest rewritten to point at the pickle is refused by name, before the object is read.
    raw = json.loads(store.fs.cat_file(f"{stage}/trajectories.manifest.json"))
    raw["objects"][0]["name"] = "trajectories-00001-evil.pkl"
    store.fs.pipe_file(f"{stage}/trajectories.manifest.json", json.dumps(raw).encode())
    with pytest.raises(ValueError, match="must end with"):
        store.read_trajectories("run1", 0, "rollouts")
    # Pickle bytes under a .parquet name: parquet refuses them, they are never unpickled.
    raw["objects"][0]["name"] = manifest.objects[0].name
    store.fs.pipe_file(f"{stage}/trajectories.manifest.json", json.dumps(raw).encode())
    store.fs.pipe_file(f"{stage}/{manifest.objects[0].name}", payload)
    with pytest.raises(ChecksumError):
        store.read_trajectories("run1", 0, "rollouts")
    assert not sentinel.exists()


def test_no_pickle_in_the_data_plane() -> None:
    root = Path(__file__).parents[2] / "ragen_tasks"
    for folder in ("data", "validation"):
        for path in (root / folder).glob("*.py"):
            text = path.read_text()
            assert "import pickle" not in text and "torch.load" not in text and "pd.read_pickle" not in text, path


def test_checkpoint_folder_upload_download(store_root: str, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    (local / "sub").mkdir(parents=True)
    (local / "model.safetensors").write_bytes(os.urandom(3000))
    (local / "sub" / "rng.json").write_text("{}")
    (local / "COMMITTED.json").write_text('{"step": 5}')
    store = Store(store_root)
    uploaded: list[str] = []
    real_put = store.fs.put_file
    store.fs.put_file = lambda lp, rp, **kw: (uploaded.append(rp.rsplit("/", 1)[-1]), real_put(lp, rp, **kw))[1]
    uri = store.upload_checkpoint(local, "run1", 5)
    del store.fs.put_file
    assert uploaded[-1] == "COMMITTED.json" and uri.endswith("run1/checkpoints/step_000005")
    assert store.fs.exists(f"{store._root}/run1/checkpoints/step_000005/{DIR_MANIFEST}")
    assert store.list_checkpoints("run1") == [5]
    out = store.download_checkpoint("run1", 5, tmp_path / "restored")
    for rel in ("model.safetensors", "sub/rng.json", "COMMITTED.json"):
        assert (out / rel).read_bytes() == (local / rel).read_bytes()
    assert store.download_checkpoint("run1", 5, tmp_path / "restored") == out  # idempotent
    # A folder without the store manifest (upload killed before the marker) is refused.
    store.fs.rm(f"{store._root}/run1/checkpoints/step_000005/{DIR_MANIFEST}")
    assert store.list_checkpoints("run1") == []
    with pytest.raises(ManifestError, match="not committed"):
        store.download_checkpoint("run1", 5, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_checkpoint_download_detects_tampering(tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"weights")
    store = Store(str(tmp_path / "store"))
    store.upload_checkpoint(local, "run1", 1)
    (tmp_path / "store/run1/checkpoints/step_000001/model.safetensors").write_bytes(b"evil")
    with pytest.raises(ChecksumError):
        store.download_checkpoint("run1", 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_credentials_never_logged(s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="ragen_tasks")
    store = Store(f"s3://{s3_bucket}/runs")
    store.write_trajectories("run1", 0, "rollouts", factory.make_batch(2), **W)
    assert "s3://" in caplog.text and "testing" not in caplog.text


def test_uri_and_relative_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = Store("runs")
    assert store.root_uri == f"file://{tmp_path}/runs"
    assert (
        store.uri("r1", 3, "batch", "trajectories")
        == f"file://{tmp_path}/runs/r1/iter_000003/batch/trajectories.manifest.json"
    )
    assert store.uri("r1", 3) == f"file://{tmp_path}/runs/r1/iter_000003"


def test_non_json_extra_refused_before_commit(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    with pytest.raises(TypeError):
        store.write_trajectories("run1", 0, "rollouts", factory.make_batch(2), **W, extra={"bad": object()})
    assert not store.has_manifest("run1", 0, "rollouts")


def test_listings_name_iterations_and_committed_items_only(store_root: str) -> None:
    store = Store(store_root)
    assert store.iterations("run1") == [] and store.committed_names("run1", 0, "rollouts") == []
    batch = factory.make_batch(4)
    store.write_trajectories("run1", 0, "rollouts", batch, **W, name="w-a-000000")
    store.write_trajectories("run1", 2, "rollouts", batch, **W)
    store.write_json("run1", 2, "summary", "summary", {"x": 1}, producer="test")
    store.upload_dir(_checkpoint_folder(store_root), "run1/checkpoints/step_000001", marker=None)
    store._put_bytes("run1/iter_000002/rollouts/w-b-000000-0123456789abcdef.parquet", b"orphan")  # no manifest
    assert store.iterations("run1") == [0, 2]  # not checkpoints/ or anything else in the run folder
    assert store.committed_names("run1", 0, "rollouts") == ["w-a-000000"]
    assert store.committed_names("run1", 2, "rollouts") == ["trajectories"]
    assert store.committed_names("run1", 1, "rollouts") == []


def _checkpoint_folder(store_root: str) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp()) / "step"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_an_oversized_manifest_is_refused_without_reading_it_whole(store_root: str) -> None:
    """A hostile bucket can plant a huge 'manifest': the reader reads at most the bound, then refuses."""
    from ragen_tasks.data.store import MAX_MANIFEST_BYTES

    store = Store(store_root)
    store.put_object("run1/iter_000000/tasks/tasks.manifest.json", b" " * (MAX_MANIFEST_BYTES + 10))
    with pytest.raises(ManifestError, match="larger than"):
        store.read_json("run1", 0, "tasks", "tasks")


def test_a_committed_json_object_that_does_not_parse_is_a_corrupt_object(store_root: str) -> None:
    import hashlib

    from ragen_tasks.data.manifest import CorruptObjectError

    store = Store(store_root)
    manifest = store.write_json("run1", 0, "tasks", "tasks", [1, 2], producer="t")
    entry = manifest.objects[0]
    garbage = b"\xff not json"
    store.put_object(f"run1/iter_000000/tasks/{entry.name}", garbage)
    resigned = type(manifest)(
        **{
            **manifest.__dict__,
            "objects": (type(entry)(entry.name, hashlib.sha256(garbage).hexdigest(), len(garbage), 1),),
        }
    )
    store.put_object("run1/iter_000000/tasks/tasks.manifest.json", resigned.to_json_bytes())
    with pytest.raises(CorruptObjectError, match="not valid JSON"):
        store.read_json("run1", 0, "tasks", "tasks")
