"""requirements.lock: the exact versions `make setup` installs (as pip constraints), and its staleness check.

    python tools/lock.py write VENV > requirements.lock   # what `make lock` runs, in a fresh venv
    python tools/lock.py check                           # exit 1 when the lock no longer fits pyproject.toml

The lock is `pip freeze` of a venv made by the Makefile's own recipe, under a header holding the
sha256 of pyproject.toml's dependency tables. It is stale when those tables changed since, or when a
requirement they state is not pinned, or pinned to a version outside its range. torch is not in the
lock: the Makefile pins it itself (torch==2.13.0, the CPU wheel), before anything else.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements.lock"
HASH_LINE = "# pyproject-dependencies-sha256: "
NOT_LOCKED = {"torch"}  # installed first by the Makefile with its own pin
REGENERATE = "make lock"


def dependency_tables(pyproject: Path = PYPROJECT) -> dict[str, object]:
    """The parts of pyproject.toml that decide what gets installed."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
    }


def dependencies_hash(pyproject: Path = PYPROJECT) -> str:
    return hashlib.sha256(json.dumps(dependency_tables(pyproject), sort_keys=True).encode()).hexdigest()


def pins(lock_text: str) -> dict[str, Version]:
    """``name==version`` lines of a lock, by canonical name."""
    result = {}
    for line in lock_text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"requirements.lock: {line!r} is not name==version; regenerate with `{REGENERATE}`")
            result[canonicalize_name(name)] = Version(version)
    return result


def problems(pyproject: Path = PYPROJECT, lock: Path = LOCK) -> list[str]:
    """Why the lock is stale (empty when it is not)."""
    if not lock.is_file():
        return [f"{lock.name} does not exist"]
    text = lock.read_text()
    found = []
    if f"{HASH_LINE}{dependencies_hash(pyproject)}" not in text:
        found.append("pyproject.toml's dependencies changed since the lock was written")
    pinned = pins(text)
    tables = dependency_tables(pyproject)
    wanted = list(tables["dependencies"])  # type: ignore[call-overload]
    for extra in tables["optional-dependencies"].values():  # type: ignore[attr-defined]
        wanted.extend(extra)
    for spec in map(Requirement, wanted):
        name = canonicalize_name(spec.name)
        if name in NOT_LOCKED:
            continue
        if name not in pinned:
            found.append(f"{spec.name} is required by pyproject.toml but not pinned")
        elif not spec.specifier.contains(pinned[name], prereleases=True):
            found.append(f"{spec.name}=={pinned[name]} does not satisfy pyproject.toml's {spec}")
    return found


def write(venv: Path) -> str:
    """The lock of the packages installed in ``venv`` (the project itself and torch left out)."""
    excluded = [arg for name in sorted(NOT_LOCKED) for arg in ("--exclude", name)]
    frozen = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable", *excluded],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = sorted((line for line in frozen.splitlines() if "==" in line), key=str.lower)
    header = [
        "# The exact versions `make setup` installs (pip constraints). Do not edit: regenerate with",
        f"#   {REGENERATE}",
        "# (a fresh venv made by the Makefile's recipe, then `python tools/lock.py write`). torch is pinned by",
        "# the Makefile itself. CI fails (tests/deploy/test_lock.py) when this no longer fits pyproject.toml.",
        f"{HASH_LINE}{dependencies_hash()}",
    ]
    return "\n".join([*header, *lines]) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"] and len(argv) == 2:
        sys.stdout.write(write(Path(argv[1])))
        return 0
    if argv == ["check"]:
        found = problems()
        for problem in found:
            print(f"requirements.lock is stale: {problem}; regenerate with `{REGENERATE}`", file=sys.stderr)
        return 1 if found else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
