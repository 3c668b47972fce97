"""requirements.lock: fits pyproject.toml (CI fails when it is stale), says how to regenerate it,
and is what the test environment runs with (so a fresh `make` gets the versions tests passed with)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _lock_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ragen_lock_tool", ROOT / "tools" / "lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lock = _lock_tool()


def test_the_lock_is_not_stale() -> None:
    assert lock.problems() == [], f"requirements.lock is stale: regenerate with `{lock.REGENERATE}`"
    assert "make lock" in (ROOT / "requirements.lock").read_text()
    assert "\nlock:" in (ROOT / "Makefile").read_text() and "-c $(LOCK)" in (ROOT / "Makefile").read_text()


def test_staleness_is_detected(tmp_path: Path) -> None:
    pyproject, stale = tmp_path / "pyproject.toml", tmp_path / "requirements.lock"
    shutil.copy(ROOT / "pyproject.toml", pyproject)
    shutil.copy(ROOT / "requirements.lock", stale)
    assert lock.problems(pyproject, stale) == []
    pyproject.write_text(pyproject.read_text().replace('"pyyaml>=6",', '"pyyaml>=6",\n  "left-pad>=1",'))
    found = lock.problems(pyproject, stale)
    assert any("dependencies changed" in p for p in found) and any("left-pad" in p for p in found)
    shutil.copy(ROOT / "pyproject.toml", pyproject)
    stale.write_text(stale.read_text().replace("\nSQLAlchemy==2.0", "\nSQLAlchemy==2.1"))
    assert any("sqlalchemy==2.1.58 does not satisfy" in p and "<2.1" in p for p in lock.problems(pyproject, stale))


def test_the_environment_is_the_lock() -> None:
    """Every pinned package installed here has the pinned version (`make setup` installs with -c)."""
    if not (Path(sys.prefix) / ".installed").exists():
        pytest.skip(f"not a venv made by `make setup` ({sys.prefix}): its versions are the user's business")
    pinned = lock.pins((ROOT / "requirements.lock").read_text())
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {n: (str(v), installed[n]) for n, v in pinned.items() if n in installed and installed[n] != str(v)}
    assert not wrong, f"installed versions differ from requirements.lock (name: (lock, installed)): {wrong}"
