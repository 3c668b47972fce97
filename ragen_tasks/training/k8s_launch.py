"""A multi-node update (``update.nnodes > 1``) as a Kubernetes Indexed Job + headless Service.

The update stage calls :func:`launch_indexed_job` instead of starting torchrun in its own pod. It
renders two objects (:func:`render_manifests`), creates them, waits for the Job, and deletes both:

- a headless Service ``<name>`` selecting the Job's pods, so pod ``k`` resolves as
  ``<name>-k.<name>`` (Indexed Job pods get hostname ``<name>-<index>``, subdomain ``<name>``);
- an Indexed Job ``<name>``: completions = parallelism = ``update.nnodes``, one pod per node with
  ``update.ranks_per_node`` GPUs, each running ``torchrun --nnodes M --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint <name>-0.<name>:29400 -m ragen_tasks.pipeline.update_ranks
  <run-uri> <iteration>``. Pod 0 hosts the rendezvous store (``is_host``); global ranks are assigned
  by the rendezvous (``--node-rank`` is ignored by c10d, so it is not passed). Rank 0 commits the
  checkpoint and the metrics to the run's store; a pod exits 0 only when its ranks did.

Every rank writes its checkpoint parts into one folder under ``$RAGEN_SCRATCH``, so all pods mount
one ReadWriteMany PVC (``update.scratch_pvc``) at ``/scratch``, and the run must be on an ``s3://``
store (the stage's pod and the update pods share nothing else). Same pod-security posture as the
GPU work-pool template (restricted profile, ServiceAccount ``ragen-job`` without a token, S3 Secret
``ragen-s3`` via ``envFrom``, optional). The ``kubernetes`` client is imported only when a Job is
launched (the ``k8s`` extra; the GPU image installs it). No Job outlives this call: it is deleted on
success, failure, timeout and interruption (``ttlSecondsAfterFinished`` backs that up if this
process dies).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shlex
import time
from collections.abc import Callable
from typing import Any, Protocol

from ragen_tasks.config import ConfigError, TrainConfig
from ragen_tasks.data.keys import check_index, check_run_id

logger = logging.getLogger(__name__)

RANK_MODULE = "ragen_tasks.pipeline.update_ranks"  # the rank program (python -m ... <run-uri> <iteration>)
RDZV_PORT = 29400  # torchrun's c10d rendezvous store, hosted by pod 0
SCRATCH = "/scratch"  # mount path of update.scratch_pvc = $RAGEN_SCRATCH
CONTAINER = "rank"
SERVICE_ACCOUNT = "ragen-job"  # k8s/rbac.yaml: no RBAC, no token
S3_SECRET = "ragen-s3"  # k8s/README.md step 2 (optional: pod identity works without it)
IMAGE_ENV = "RAGEN_UPDATE_IMAGE"  # set by k8s/base-job-template-gpu.json to the pod's own image
JOB_LABEL = "ragen.io/update-job"  # selects one update's pods (Service selector, log queries)
POD_LABELS = {  # k8s/networkpolicy.yaml keys on these
    "app.kubernetes.io/part-of": "ragen",
    "app.kubernetes.io/component": "flow-run",  # DNS, Prefect API and S3 egress
    "ragen.io/role": "update-rank",  # rendezvous + NCCL traffic between update pods
    "ragen.io/service-account": SERVICE_ACCOUNT,
}
FINISHED_TTL_S = 3600  # the cluster deletes a finished Job this long after, if this process could not
MAX_NAME = 52  # <name>-<index>-<5 random> (the pod name) and <name>-<index> (hostname) stay <= 63
_SLUG_MAX = 24
_LOG_TAIL_LINES = 40


class UpdateJobError(RuntimeError):
    """The Indexed Job failed, timed out or could not be created. The message is one line."""


class BatchApi(Protocol):
    """The part of ``kubernetes.client.BatchV1Api`` used here."""

    def create_namespaced_job(self, namespace: str, body: Any) -> Any: ...
    def read_namespaced_job_status(self, name: str, namespace: str) -> Any: ...
    def delete_namespaced_job(self, name: str, namespace: str, *, propagation_policy: str) -> Any: ...


class CoreApi(Protocol):
    """The part of ``kubernetes.client.CoreV1Api`` used here."""

    def create_namespaced_service(self, namespace: str, body: Any) -> Any: ...
    def delete_namespaced_service(self, name: str, namespace: str) -> Any: ...
    def list_namespaced_pod(self, namespace: str, *, label_selector: str) -> Any: ...
    def read_namespaced_pod_log(self, name: str, namespace: str, *, container: str, tail_lines: int) -> Any: ...


# ---------------------------------------------------------------------------------------------
# Rendering (pure)
# ---------------------------------------------------------------------------------------------
def job_name(run_uri: str, iteration: int) -> str:
    """``ragen-upd-<run id slug>-<hash>-<iteration>``: a DNS label (also a valid Service name) of at
    most :data:`MAX_NAME` characters, the same on every retry of the iteration. The hash is of the
    whole run URI, so two runs whose ids slug alike, or one id in two stores, never share a name."""
    run_id = check_run_id(run_uri.rstrip("/").rpartition("/")[2])
    iteration = check_index(iteration, "iteration")
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")[:_SLUG_MAX].strip("-")
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:8]
    return "-".join(part for part in ("ragen-upd", slug, digest, str(iteration)) if part)


def rendezvous_host(name: str) -> str:
    """Pod 0 of Job ``name`` through its headless Service (resolved by the namespace's DNS search path)."""
    return f"{name}-0.{name}"


def rank_script(name: str, config: TrainConfig, rdzv_id: str) -> str:
    """The shell script each pod runs (``sh -c SCRIPT ragen-update-rank <run-uri> <iteration>``).

    It waits until pod 0's DNS record exists (the Service publishes not-ready pods, but a pod may
    start before pod 0 is scheduled), marks pod 0 as the rendezvous host, then execs torchrun. The
    run URI and the iteration arrive as ``$1`` / ``$2``, never spliced into the script. No ``$(``
    anywhere: Kubernetes would read it as a variable reference in ``command``.
    """
    update = config.update
    wait_s = int(update.rendezvous_timeout_s)
    torchrun = shlex.join(
        [
            "python", "-m", "torch.distributed.run",
            f"--nnodes={update.nnodes}",
            f"--nproc-per-node={update.ranks_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-id={rdzv_id}",
            "--max-restarts=0",
        ]
    )  # fmt: skip
    return "\n".join(
        [
            "set -eu",
            f"host={rendezvous_host(name)}",
            'case "${JOB_COMPLETION_INDEX:?}" in 0) is_host=1 ;; *) is_host=0 ;; esac',
            f'timeout {wait_s} sh -c \'until getent hosts "$0" >/dev/null; do sleep 2; done\' "$host" || '
            f'{{ echo "rendezvous host $host did not resolve within {wait_s} s" >&2; exit 1; }}',
            f'exec {torchrun} --rdzv-endpoint="$host:{RDZV_PORT}" '
            f'--rdzv-conf="is_host=$is_host,join_timeout={wait_s},read_timeout=300" '
            f'-m {RANK_MODULE} "$1" "$2"',
        ]
    )


def render_manifests(
    run_uri: str, iteration: int, config: TrainConfig, *, image: str, rdzv_id: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(service, job)`` of one multi-node update, as plain dicts for the Kubernetes API."""
    update = config.update
    name = job_name(run_uri, iteration)
    rdzv_id = rdzv_id or name
    gpus = str(update.ranks_per_node)
    labels = {**POD_LABELS, JOB_LABEL: name}

    def metadata() -> dict[str, Any]:  # a fresh dict per object: the client may mutate what it sends
        return {"name": name, "namespace": update.namespace, "labels": dict(labels)}

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(),
        "spec": {
            "clusterIP": "None",  # headless: one DNS record per pod, <name>-<index>.<name>
            "selector": {JOB_LABEL: name},
            "publishNotReadyAddresses": True,  # the ranks have no readiness probe; resolve them at once
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }
    env = {
        "HOME": "/tmp/home",
        "TMPDIR": "/tmp",
        "HF_HOME": "/tmp/hf",
        "HF_HUB_OFFLINE": "1",
        "RAGEN_SCRATCH": SCRATCH,
        "NCCL_DEBUG": "WARN",  # a failed collective says why in the pod's log
    }
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", rank_script(name, config, rdzv_id), "ragen-update-rank", run_uri, str(iteration)],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "envFrom": [{"secretRef": {"name": S3_SECRET, "optional": True}}],
        "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": update.cpu_per_node, "memory": update.memory_per_node, "nvidia.com/gpu": gpus},
            "limits": {"memory": update.memory_per_node, "nvidia.com/gpu": gpus},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "scratch", "mountPath": SCRATCH},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod_spec = {
        "subdomain": name,  # with the pod's hostname <name>-<index>: DNS <name>-<index>.<name>
        "restartPolicy": "Never",
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "nodeSelector": dict(update.node_selector),
        "tolerations": [dict(t) for t in update.tolerations],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "scratch", "persistentVolumeClaim": {"claimName": update.scratch_pvc}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},  # HOME, TMPDIR, JIT-built DeepSpeed ops
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": update.shm_size}},
        ],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(),
        "spec": {
            "completionMode": "Indexed",  # JOB_COMPLETION_INDEX, hostname <name>-<index>
            "completions": update.nnodes,
            "parallelism": update.nnodes,
            "backoffLimit": 0,  # one failed pod fails the update (the others are stopped)
            "activeDeadlineSeconds": max(1, int(update.job_timeout_s)),
            "ttlSecondsAfterFinished": FINISHED_TTL_S,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }
    return service, job


# ---------------------------------------------------------------------------------------------
# Launching and waiting
# ---------------------------------------------------------------------------------------------
def launch_indexed_job(
    run_uri: str,
    iteration: int,
    config: TrainConfig,
    *,
    apis: tuple[BatchApi, CoreApi] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 10.0,
) -> None:
    """Run the update of ``iteration`` on ``update.nnodes`` pods and return when every pod exited 0
    (rank 0 committed). Raises :class:`UpdateJobError` (one line, naming the Job and the first failed
    pod's reason) on failure or after ``update.job_timeout_s``; ConfigError for a config or store this
    cannot run. ``apis`` = ``(BatchV1Api, CoreV1Api)``; None = in-cluster config, else ~/.kube/config."""
    update = config.update
    if update.nnodes < 2:
        raise ConfigError(f"update.nnodes={update.nnodes}: a single-node update runs torchrun in its own pod")
    if not run_uri.startswith("s3://"):
        raise ConfigError(
            f"update.nnodes={update.nnodes} needs the run on an s3:// store (store.root), got {run_uri!r}: "
            "the update pods share only the store and the scratch PVC with this pod"
        )
    ranks = update.nnodes * update.ranks_per_node
    if config.optim.minibatch_size < ranks:
        raise ConfigError(
            f"optim.minibatch_size={config.optim.minibatch_size} is smaller than the {ranks} ranks of the update "
            f"(update.nnodes={update.nnodes} x {update.ranks_per_node} per node): every rank needs a trajectory"
        )
    image = update.image or os.environ.get(IMAGE_ENV, "")
    if not image:
        raise ConfigError(f"no image for the update pods: set update.image or ${IMAGE_ENV}")
    name, namespace = job_name(run_uri, iteration), update.namespace
    service, job = render_manifests(run_uri, iteration, config, image=image, rdzv_id=f"{name}-{secrets.token_hex(4)}")
    batch, core = apis or _clients()
    where = f"update job {namespace}/{name}"
    deadline = clock() + update.job_timeout_s

    # A Job of an earlier attempt (this process died before its cleanup) would write the same folder.
    _delete(batch, core, name, namespace)
    while _job_status(batch, name, namespace) is not None:
        if clock() >= deadline:
            raise UpdateJobError(f"{where}: a Job of an earlier attempt is still being deleted")
        sleep(min(poll_s, 2.0))
    try:
        core.create_namespaced_service(namespace, service)
        batch.create_namespaced_job(namespace, job)
        logger.info(
            "%s: %d pods x %d ranks; logs: kubectl -n %s logs -f -l %s=%s --prefix --max-log-requests %d",
            where, update.nnodes, update.ranks_per_node, namespace, JOB_LABEL, name, update.nnodes,
        )  # fmt: skip
        while True:
            status = _job_status(batch, name, namespace)
            if status is None:
                raise UpdateJobError(f"{where} disappeared while running (deleted by someone else?)")
            condition = _finished(status)
            if condition is not None and condition.type == "Complete":
                logger.info("%s: completed", where)
                return
            if condition is not None:
                pod = _explain_pods(core, name, namespace, log_failed=True)
                raise UpdateJobError(f"{where} failed ({_one_line(condition.reason, condition.message)}); {pod}")
            if clock() >= deadline:
                pod = _explain_pods(core, name, namespace, log_failed=True)
                raise UpdateJobError(
                    f"{where} did not finish within update.job_timeout_s={update.job_timeout_s:g}; {pod}"
                )
            sleep(max(0.0, min(poll_s, deadline - clock())))
    finally:
        _delete(batch, core, name, namespace)


def _clients() -> tuple[BatchApi, CoreApi]:
    try:
        import kubernetes
    except ImportError as exc:
        raise ConfigError(
            "update.nnodes > 1 needs the kubernetes client: pip install 'ragen-tasks[k8s]' (the GPU image has it)"
        ) from exc
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]  # untyped in kubernetes
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]  # outside a cluster: current context
    return kubernetes.client.BatchV1Api(), kubernetes.client.CoreV1Api()


def _status_code(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)  # kubernetes.client.exceptions.ApiException.status
    return status if isinstance(status, int) else None


def _job_status(batch: BatchApi, name: str, namespace: str) -> Any | None:
    """The Job's ``.status`` (V1JobStatus), None when the Job does not exist."""
    try:
        return batch.read_namespaced_job_status(name, namespace).status
    except Exception as exc:
        if _status_code(exc) == 404:
            return None
        raise


def _finished(status: Any) -> Any | None:
    """The Job's terminal condition (type Complete or Failed, status True), None while it runs."""
    for condition in getattr(status, "conditions", None) or []:
        if condition.type in ("Complete", "Failed") and condition.status == "True":
            return condition
    return None


def _delete(batch: BatchApi, core: CoreApi, name: str, namespace: str) -> None:
    """Delete the Job (and, foreground, its pods) and the Service; absent ones are fine."""
    try:
        batch.delete_namespaced_job(name, namespace, propagation_policy="Foreground")
    except Exception as exc:
        _unless_missing(exc, f"Job {namespace}/{name}")
    try:
        core.delete_namespaced_service(name, namespace)
    except Exception as exc:
        _unless_missing(exc, f"Service {namespace}/{name}")


def _unless_missing(exc: Exception, what: str) -> None:
    if _status_code(exc) != 404:  # cleanup goes on; the Job's TTL deletes what is left
        logger.warning("could not delete %s: %s", what, _one_line(str(exc))[:200])


def _one_line(*parts: object) -> str:
    return " ".join(" ".join(str(p).split()) for p in parts if p)


def _pod_state(pod: Any) -> tuple[int, str, str]:
    """(rank, when, reason) of one pod: rank 0 = a container failed (sorted by when), 1 = the pod
    failed or cannot start/schedule, 2 = nothing wrong seen."""
    status = pod.status
    for cs in getattr(status, "container_statuses", None) or []:
        state = cs.state
        terminated = getattr(state, "terminated", None)
        if terminated is not None and terminated.exit_code != 0:
            when = str(terminated.finished_at or "")
            return 0, when, f"{terminated.reason or 'Error'} (exit code {terminated.exit_code})"
        waiting = getattr(state, "waiting", None)
        if waiting is not None and waiting.reason not in (None, "ContainerCreating", "PodInitializing"):
            return 1, "", _one_line(waiting.reason, waiting.message)
    if getattr(status, "reason", None):  # Evicted, DeadlineExceeded, ...
        return 1, "", _one_line(status.reason, status.message)
    for condition in getattr(status, "conditions", None) or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return 1, "", _one_line(condition.reason, condition.message)
    return 2, "", f"phase {getattr(status, 'phase', None) or 'unknown'}"


def _explain_pods(core: CoreApi, name: str, namespace: str, *, log_failed: bool) -> str:
    """'pod X: reason' for the pod that explains the outcome best (the first container to fail), and
    that pod's log tail at ERROR level (the pods are deleted next)."""
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={name}").items or []
    except Exception as exc:
        return f"its pods could not be listed ({_one_line(str(exc))[:200]})"
    if not pods:
        return "no pod was created (quota, admission or an invalid manifest: kubectl describe job)"
    ranked = sorted(((*_pod_state(p), p.metadata.name) for p in pods), key=lambda s: (s[0], s[1], s[3]))
    rank, _, reason, pod_name = ranked[0]
    if log_failed and rank == 0:
        try:
            tail = core.read_namespaced_pod_log(pod_name, namespace, container=CONTAINER, tail_lines=_LOG_TAIL_LINES)
            logger.error("last %d log lines of %s/%s:\n%s", _LOG_TAIL_LINES, namespace, pod_name, tail)
        except Exception as exc:
            logger.warning("could not read the log of %s/%s: %s", namespace, pod_name, _one_line(str(exc))[:200])
    return f"pod {pod_name}: {reason}"
