"""prefect.yaml against a real Prefect server on 127.0.0.1 and a process worker, as an operator uses it.

One server for the module (its own PREFECT_HOME and SQLite database), the three work pools the README
creates, then: `prefect deploy --all` registers every deployment on a machine without Docker and
installs nothing; a deployment with a 5-second interval schedule gets runs created by the server's
scheduler and completed by the worker; a run created the way the UI's form does (`prefect deployment
run -p ...`) of evaluate-local completes and writes its record, the regression-eval-local
deployment passes a good checkpoint against it and fails a damaged one; a preset outside the form's
choices, a bound or a pattern broken are refused when the run is created, and an unknown parameter
is refused by the CLI (a raw API post gets a run whose log names it: Prefect cannot refuse it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import stop_process

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A `prefect server start` on 127.0.0.1 and the environment that points the CLI at it."""

    def __init__(self, home: Path) -> None:
        port = _free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            # The scheduler and the worker poll every second (defaults: 60 s and 10 s); the scheduler
            # keeps only a few runs ahead (default: 100), so a 5-second schedule stays cheap to query.
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
            "PREFECT_SERVER_SERVICES_SCHEDULER_MIN_RUNS": "2",
            "PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS": "3",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        self.log = open(home / "server.log", "w")  # noqa: SIM115  # closed in stop()
        self.proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_until_healthy(home / "server.log")
        except BaseException:  # also Ctrl-C while it starts: never leave the server behind
            self.stop()
            raise

    def _wait_until_healthy(self, log: Path) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        raise TimeoutError(f"Prefect server did not start: {log.read_text()[-3000:]}")

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [PREFECT, "--no-prompt", *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        if check:
            assert done.returncode == 0, f"prefect {' '.join(args)}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST to the API, retrying a 503 as Prefect's own client does: the server answers 503 for errors it
        marks retryable (SQLite busy on 2 loaded cores), after rolling the request back."""
        for backoff_s in (1, 2, 4, 8, 0):  # five tries; no wait after the last
            response = httpx.post(f"{self.api}{path}", json=body, timeout=120)
            if response.status_code != httpx.codes.SERVICE_UNAVAILABLE:
                break
            time.sleep(backoff_s)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("prefect-server"))
    try:
        running.cli("work-pool", "create", "local-process", "--type", "process")
        for pool in ("gpu", "cpu"):
            running.cli(
                "work-pool", "create", f"k8s-{pool}", "--type", "kubernetes",
                "--base-job-template", str(ROOT / "k8s" / f"base-job-template-{pool}.json"),
            )  # fmt: skip
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def deployed(server: Server) -> subprocess.CompletedProcess[str]:
    return server.cli("deploy", "--all")  # as an operator would: RAGEN_HOME is the worker's, not set here


@pytest.fixture(scope="module")
def worker(
    server: Server, deployed: subprocess.CompletedProcess[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    log = open(tmp_path_factory.mktemp("worker") / "worker.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "local-process", "--type", "process"],
        env={**server.env, "RAGEN_HOME": str(ROOT)},  # the local deployments' pull step: run from this checkout
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield
    finally:
        stop_process(proc, timeout=30)
        log.close()


def _deployments(server: Server) -> dict[str, dict[str, Any]]:
    flows = {f["id"]: f["name"] for f in server.post("/flows/filter", {})}
    return {f"{flows[d['flow_id']]}/{d['name']}": d for d in server.post("/deployments/filter", {})}


def _wait_for_runs(
    server: Server, deployment_id: str, *, count: int, states: set[str], timeout: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    runs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        runs = server.post(
            "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "limit": 50}
        )
        done = [r for r in runs if r["state_type"] in states]
        if len(done) >= count:
            return done
        time.sleep(3)
    raise TimeoutError(f"{count} runs in {states} not reached: {[(r['name'], r['state_name']) for r in runs]}")


def test_deploy_all_registers_every_deployment_without_docker_or_pip(server: Server, deployed: Any) -> None:
    output = deployed.stdout + deployed.stderr
    for forbidden in ("pip install", "Installing", "docker", "Docker"):
        assert forbidden not in output, f"`prefect deploy --all` printed {forbidden!r}:\n{output[-3000:]}"
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    registered = _deployments(server)
    names = {name.split("/")[1]: dep for name, dep in registered.items()}
    assert set(names) == {d["name"] for d in config["deployments"]}
    assert "ragen-train/train" in registered and "ragen-regression-eval/regression-eval-local" in registered
    for spec in config["deployments"]:
        dep = names[spec["name"]]
        (step,) = dep["pull_steps"]
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        local = spec["work_pool"]["name"] == "local-process"
        assert directory == ("{{ $RAGEN_HOME }}" if local else "/opt/ragen"), spec["name"]
        assert dep["parameter_openapi_schema"]["properties"], spec["name"]


def test_a_short_interval_schedule_fires_and_the_worker_completes_the_runs(server: Server, worker: None) -> None:
    # Deployed ad hoc (not in prefect.yaml): it inherits the local checkout's pull step, not /opt/ragen.
    server.cli(
        "deploy", "tests/deploy/ping_flow.py:ping", "--name", "every-5s", "--pool", "local-process", "--interval", "5"
    )
    dep = _deployments(server)["ragen-ping/every-5s"]
    (step,) = dep["pull_steps"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $RAGEN_HOME }}"
    runs = _wait_for_runs(server, dep["id"], count=2, states={"COMPLETED"}, timeout=240)
    assert all(r["auto_scheduled"] for r in runs), "the runs were created by the server's scheduler"
    server.cli("deployment", "delete", "ragen-ping/every-5s")  # no more runs beside the next test's


def test_form_style_runs_of_evaluate_and_the_regression_deployment(
    server: Server, worker: None, gate_checkpoints: dict[str, str], tmp_path: Path
) -> None:
    record = tmp_path / "baseline.json"
    deployments = _deployments(server)
    server.cli(
        "deployment", "run", "ragen-evaluate/evaluate-local",
        "-p", f"checkpoint={gate_checkpoints['good']}", "-p", "seeds=16", "-p", f"output={record}",
    )  # fmt: skip
    _wait_for_runs(
        server, deployments["ragen-evaluate/evaluate-local"]["id"], count=1, states={"COMPLETED"}, timeout=300
    )
    assert json.loads(record.read_text())["seeds"] == 16

    gate_id = deployments["ragen-regression-eval/regression-eval-local"]["id"]
    server.cli("deployment", "run", "ragen-regression-eval/regression-eval-local",
               "-p", f"checkpoint={gate_checkpoints['good']}", "-p", f"baseline={record}")  # fmt: skip
    _wait_for_runs(server, gate_id, count=1, states={"COMPLETED"}, timeout=300)
    server.cli("deployment", "run", "ragen-regression-eval/regression-eval-local",
               "-p", f"checkpoint={gate_checkpoints['damaged']}", "-p", f"baseline={record}")  # fmt: skip
    (failed,) = _wait_for_runs(server, gate_id, count=1, states={"FAILED"}, timeout=300)
    assert "REGRESSED" in json.dumps(failed["state"]), failed["state"]


def test_bad_form_values_are_refused_when_the_run_is_created(server: Server, deployed: Any) -> None:
    for bad in ("preset=no-such-preset", "iterations=0", "run_id=../escape"):
        refused = server.cli("deployment", "run", "ragen-train/train-local", "-p", bad, check=False)
        assert refused.returncode != 0, bad
        assert bad.split("=")[1] in refused.stdout + refused.stderr, (bad, refused.stdout, refused.stderr)


def test_an_unknown_parameter_is_refused_at_creation_or_named_in_the_runs_log(server: Server, worker: None) -> None:
    # The CLI (and the UI's form, which offers only the flow's parameters) refuse it: no run is created.
    refused = server.cli("deployment", "run", "ragen-train/train-local", "-p", "iteratons=3", check=False)
    assert refused.returncode != 0 and "iteratons" in refused.stdout + refused.stderr
    # The API itself (a raw JSON post) cannot: Prefect's parameter schema has no way to forbid extra
    # keys, and Prefect's engine refuses the call before the flow's code runs (the run ends Crashed).
    # What the user gets is the run's log naming the parameter, seconds after the worker picks it up.
    train_local = _deployments(server)["ragen-train/train-local"]["id"]
    created = server.post(f"/deployments/{train_local}/create_flow_run", {"parameters": {"iteratons": 3}})
    _wait_for_runs(server, train_local, count=1, states={"FAILED", "CRASHED"}, timeout=300)
    logs = server.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [created["id"]]}}})
    assert any("iteratons" in log["message"] for log in logs), [log["message"] for log in logs]
