"""The multi-node update launcher's edges (create, wait, explain, clean up) against a double of the
Kubernetes API: BatchV1Api / CoreV1Api answering with the client's own models and ApiException.
The manifests it renders are validated in tests/deploy/test_k8s_manifests.py. No cluster here."""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Job,
    V1JobCondition,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from ragen_tasks.config import ConfigError, TrainConfig
from ragen_tasks.training import k8s_launch
from ragen_tasks.training.k8s_launch import UpdateJobError, launch_indexed_job

ROOT = Path(__file__).resolve().parents[2]
RUN = "s3://ragen-runs/runs/exp1"

# What each API call needs from RBAC: (apiGroup, resource, verb).
RBAC = {
    "create_namespaced_job": ("batch", "jobs", "create"),
    "read_namespaced_job_status": ("batch", "jobs/status", "get"),
    "delete_namespaced_job": ("batch", "jobs", "delete"),
    "create_namespaced_service": ("", "services", "create"),
    "delete_namespaced_service": ("", "services", "delete"),
    "list_namespaced_pod": ("", "pods", "list"),
    "read_namespaced_pod_log": ("", "pods/log", "get"),
}


def condition(kind: str, reason: str = "", message: str = "") -> V1JobCondition:
    return V1JobCondition(type=kind, status="True", reason=reason, message=message)


RUNNING = V1JobStatus(active=2)
COMPLETE = V1JobStatus(succeeded=2, conditions=[condition("Complete")])
FAILED = V1JobStatus(failed=1, conditions=[condition("Failed", "BackoffLimitExceeded", "Job has reached the\nlimit")])


def pod(name: str, *, exit_code: int | None = None, at: int = 0, unschedulable: str = "") -> V1Pod:
    statuses, conditions = None, None
    if exit_code is not None:
        done = V1ContainerStateTerminated(
            exit_code=exit_code, reason="Error", finished_at=datetime(2025, 1, 1, 0, 0, at, tzinfo=UTC)
        )
        statuses = [
            V1ContainerStatus(
                name="rank",
                image="i",
                image_id="",
                ready=False,
                restart_count=0,
                state=V1ContainerState(terminated=done),
            )
        ]
    if unschedulable:
        conditions = [
            V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable", message=unschedulable)
        ]
    phase = "Pending" if unschedulable else ("Failed" if exit_code else "Running")
    return V1Pod(
        metadata=V1ObjectMeta(name=name),
        status=V1PodStatus(phase=phase, container_statuses=statuses, conditions=conditions),
    )


class FakeKube:
    """BatchV1Api + CoreV1Api in one: a Job whose status reads follow ``statuses`` (the last repeats)."""

    def __init__(self, statuses: list[V1JobStatus], pods: list[V1Pod] = (), leftover_reads: int = 0) -> None:  # type: ignore[assignment]
        self.statuses, self.pods = list(statuses), list(pods)
        self.calls: list[tuple[str, Any]] = []
        self.job: dict[str, Any] | None = None
        self.service: dict[str, Any] | None = None
        self.leftover_reads = leftover_reads  # an earlier attempt's Job, still there for this many reads
        self.deleting = False

    def _missing(self) -> ApiException:
        return ApiException(status=404, reason="Not Found")

    def create_namespaced_service(self, namespace: str, body: Any) -> None:
        self.calls.append(("create_namespaced_service", body["metadata"]["name"]))
        self.service = body

    def create_namespaced_job(self, namespace: str, body: Any) -> None:
        self.calls.append(("create_namespaced_job", body["metadata"]["name"]))
        self.created_job = body
        if self.leftover_reads:
            raise ApiException(status=409, reason="AlreadyExists")
        self.job = body

    def read_namespaced_job_status(self, name: str, namespace: str) -> V1Job:
        self.calls.append(("read_namespaced_job_status", name))
        if self.leftover_reads:
            self.leftover_reads -= 1
            return V1Job(status=RUNNING)
        if self.job is None:
            raise self._missing()
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return V1Job(status=status)

    def delete_namespaced_job(self, name: str, namespace: str, *, propagation_policy: str) -> None:
        self.calls.append(("delete_namespaced_job", propagation_policy))
        if self.job is None and not self.leftover_reads:
            raise self._missing()
        self.job = None

    def delete_namespaced_service(self, name: str, namespace: str) -> None:
        self.calls.append(("delete_namespaced_service", name))
        if self.service is None:
            raise self._missing()
        self.service = None

    def list_namespaced_pod(self, namespace: str, *, label_selector: str) -> V1PodList:
        self.calls.append(("list_namespaced_pod", label_selector))
        return V1PodList(items=self.pods)

    def read_namespaced_pod_log(self, name: str, namespace: str, *, container: str, tail_lines: int) -> str:
        self.calls.append(("read_namespaced_pod_log", name))
        return "Traceback (most recent call last):\nRuntimeError: NCCL error"

    def called(self) -> list[str]:
        return [name for name, _ in self.calls]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def config(**update: Any) -> TrainConfig:
    return TrainConfig.model_validate({"update": {"nnodes": 2, "world_size": 4, **update}})


def launch(kube: FakeKube, cfg: TrainConfig | None = None, run: str = RUN, clock: Clock | None = None) -> Clock:
    clock = clock or Clock()
    launch_indexed_job(
        run, 3, cfg or config(image="reg/ragen-gpu:abc"), apis=(kube, kube), sleep=clock.sleep, clock=clock
    )
    return clock


def test_success_creates_service_then_job_waits_and_deletes_both() -> None:
    kube = FakeKube([RUNNING, RUNNING, COMPLETE])
    clock = launch(kube)
    name = k8s_launch.job_name(RUN, 3)
    created = [c for c in kube.calls if c[0].startswith("create")]
    assert created == [("create_namespaced_service", name), ("create_namespaced_job", name)]
    assert kube.called()[-2:] == ["delete_namespaced_job", "delete_namespaced_service"]
    assert ("delete_namespaced_job", "Foreground") in kube.calls  # the pods go with the Job
    assert kube.job is None and kube.service is None
    assert clock.now == 20.0  # two polls of 10 s
    assert "list_namespaced_pod" not in kube.called()


def test_failure_names_the_job_and_the_first_pod_that_failed(caplog: pytest.LogCaptureFixture) -> None:
    pods = [pod("p-0", exit_code=137, at=9), pod("p-1", exit_code=1, at=3), pod("p-2")]
    kube = FakeKube([RUNNING, FAILED], pods)
    with caplog.at_level(logging.ERROR), pytest.raises(UpdateJobError) as err:
        launch(kube)
    message = str(err.value)
    assert "\n" not in message
    name = k8s_launch.job_name(RUN, 3)
    assert f"update job ragen/{name} failed (BackoffLimitExceeded Job has reached the limit)" in message
    assert message.endswith("pod p-1: Error (exit code 1)")  # the first to fail, not the one killed after
    assert ("read_namespaced_pod_log", "p-1") in kube.calls and "NCCL error" in caplog.text
    assert kube.job is None and kube.service is None


def test_timeout_deletes_the_job_and_says_why_pods_did_not_run() -> None:
    pods = [pod("p-0"), pod("p-1", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")]
    kube = FakeKube([RUNNING], pods)
    clock = Clock()
    with pytest.raises(UpdateJobError) as err:
        launch(kube, config(image="reg/ragen-gpu:abc", job_timeout_s=95), clock=clock)
    message = str(err.value)
    assert "did not finish within update.job_timeout_s=95" in message
    assert "pod p-1: Unschedulable 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in message
    assert clock.now == 95.0  # the last sleep is cut to the deadline
    assert "read_namespaced_pod_log" not in kube.called()  # nothing ran, nothing to read
    assert kube.job is None and kube.service is None


def test_an_earlier_attempts_job_is_deleted_and_gone_before_the_new_one() -> None:
    kube = FakeKube([COMPLETE], leftover_reads=2)
    launch(kube)
    calls = kube.called()
    first_create = calls.index("create_namespaced_service")
    assert calls[:2] == ["delete_namespaced_job", "delete_namespaced_service"]
    assert calls[2:first_create] == ["read_namespaced_job_status"] * 3  # 2 x still there, then 404


def test_interrupted_wait_still_deletes() -> None:
    class Boom(Exception):
        pass

    kube = FakeKube([RUNNING])

    def sleep(_: float) -> None:
        raise Boom

    with pytest.raises(Boom):
        launch_indexed_job(RUN, 3, config(image="i"), apis=(kube, kube), sleep=sleep, clock=Clock())
    assert kube.job is None and kube.service is None


def test_image_defaults_to_the_pods_own(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([COMPLETE])
    monkeypatch.setenv(k8s_launch.IMAGE_ENV, "reg/ragen-gpu:fromenv")
    launch(kube, config())
    assert kube.created_job["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/ragen-gpu:fromenv"
    monkeypatch.delenv(k8s_launch.IMAGE_ENV)
    with pytest.raises(ConfigError, match=r"update\.image or \$RAGEN_UPDATE_IMAGE"):
        launch(FakeKube([COMPLETE]), config())


def test_created_job_is_the_rendered_manifest() -> None:
    kube = FakeKube([COMPLETE])
    launch(kube, config(image="reg/x:1", gpus_per_node=4, world_size=0))
    job = kube.created_job
    assert job["spec"]["completions"] == 2 and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/x:1"
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "--nnodes=2" in script and "--nproc-per-node=4" in script
    assert f"--rdzv-id={job['metadata']['name']}-" in script  # unique per launch


@pytest.mark.parametrize(
    "cfg,run,match",
    [
        (config(image="i"), "runs/exp1", r"needs the run on an s3:// store"),
        (config(image="i", world_size=8, nnodes=8), RUN, r"optim\.minibatch_size=32 is smaller than the 64 ranks"),
        (TrainConfig(), RUN, r"update\.nnodes=1"),
    ],
)
def test_what_cannot_run_fails_before_any_api_call(cfg: TrainConfig, run: str, match: str) -> None:
    kube = FakeKube([COMPLETE])
    with pytest.raises(ConfigError, match=match):
        launch(kube, cfg, run=run)
    assert kube.calls == []


def test_every_api_call_is_allowed_by_the_launcher_role() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "k8s" / "rbac.yaml").read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "ragen-update-launcher"]
    allowed = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    used: set[str] = set()
    for kube in (FakeKube([COMPLETE], leftover_reads=1), FakeKube([FAILED], [pod("p", exit_code=1)])):
        with contextlib.suppress(UpdateJobError):
            launch(kube)
        used |= set(kube.called())
    assert used == set(RBAC)
    assert {RBAC[m] for m in used} == allowed  # every call allowed, and nothing allowed that is never called


def test_multi_node_config_names_the_fields() -> None:
    with pytest.raises(ValueError, match=r"update\.gpus_per_node"):
        TrainConfig.model_validate({"update": {"nnodes": 2, "world_size": 0}})
    with pytest.raises(ValueError, match=r"update\.world_size=4 and update\.gpus_per_node=8 disagree"):
        TrainConfig.model_validate({"update": {"nnodes": 2, "world_size": 4, "gpus_per_node": 8}})
    with pytest.raises(ValueError, match=r"update\.memory_per_node"):
        TrainConfig.model_validate({"update": {"memory_per_node": "64 GB"}})
    with pytest.raises(ValueError, match=r"update\.namespace"):
        TrainConfig.model_validate({"update": {"namespace": "Ragen_NS"}})
    assert config(world_size=0, gpus_per_node=8).update.ranks_per_node == 8
    assert TrainConfig.model_validate({"update": {"world_size": 0}}).update.ranks_per_node == 0  # one node: fine
