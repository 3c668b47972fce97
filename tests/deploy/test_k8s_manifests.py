"""Offline validation of k8s/: manifests and rendered work-pool base job templates.

No cluster exists here, so every object is checked against the kubernetes Python client's models:
a small strict validator walks each dict along the model's `openapi_types` / `attribute_map`
(unknown field, wrong primitive type = error, with the JSON path), then the client's own
deserialiser enforces required fields. On top of the schema: the "restricted" pod-security
profile on every pod spec, the Roles' exact verbs, and the Prefect worker's own template rules
(its required job skeleton, rendered the way the worker renders it). The multi-node update's Indexed
Job + headless Service (rendered by ragen_tasks.training.k8s_launch) get the same checks, plus its
torchrun command, run under sh with stand-ins for python and getent.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client import ApiClient
from prefect.utilities.templating import apply_values, find_placeholders
from prefect.workers.base import BaseJobConfiguration

from ragen_tasks.config import TrainConfig
from ragen_tasks.training import k8s_launch

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
TEMPLATES = sorted(K8S.glob("base-job-template-*.json"))
MANIFESTS = sorted(K8S.glob("*.yaml"))
UPDATE_EXAMPLE = K8S / "examples" / "update-indexed-job.yaml"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names; Job names are a subset here

# The Prefect kubernetes worker rejects a job manifest that lacks these pod-spec keys (its
# `_get_base_job_manifest` skeleton puts Job fields inside the pod spec). The API server drops them
# as unknown fields, so they are the one documented exception to strictness below.
PREFECT_POD_SPEC_QUIRKS = {"parallelism": 1, "completions": 1}

# Client versions spell containers `List[X]` / `Dict[str, X]` (new) or `list[X]` / `dict(str, X)` (old).
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^[Dd]ict[\[(](\w+), (.+)[\])]$")
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "datetime": (str,),
    "date": (str,),
    "bytearray": (str,),
}


# ---------------------------------------------------------------------------------------------
# Strict validator over kubernetes.client models
# ---------------------------------------------------------------------------------------------
def strict_errors(data: Any, type_name: str, path: str = "$") -> list[str]:
    """Errors of `data` against the client type `type_name` ('V1Job', 'list[V1Container]', 'str'...).

    Unknown keys and wrong primitive types are errors; None is treated as absent.
    """
    if data is None or type_name == "object":
        return []
    if m := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list ({type_name}), got {type(data).__name__}"]
        return [e for i, item in enumerate(data) for e in strict_errors(item, m.group(1), f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping ({type_name}), got {type(data).__name__}"]
        return [e for k, v in data.items() for e in strict_errors(v, m.group(2), f"{path}.{k}")]
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and not (type_name in ("int", "float") and isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {type(data).__name__} {data!r}"]
    model = getattr(kubernetes.client, type_name, None)
    if model is None:
        return [f"{path}: unknown model type {type_name!r}"]
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name}), got {type(data).__name__}"]
    json_to_attr = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors: list[str] = []
    for key, value in data.items():
        attr = json_to_attr.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: unknown field for {type_name}")
            continue
        errors.extend(strict_errors(value, model.openapi_types[attr], f"{path}.{key}"))
    return errors


def model_name(obj: dict[str, Any]) -> str:
    """'apps/v1' + 'Deployment' -> 'V1Deployment' (the client's naming for stable groups)."""
    version = str(obj["apiVersion"]).split("/")[-1]
    return f"{version.capitalize()}{obj['kind']}"


def validate_strict(obj: dict[str, Any]) -> None:
    """Raise AssertionError listing every schema error of one top-level object."""
    name = model_name(obj)
    errors = strict_errors(obj, name)
    assert not errors, f"{obj['kind']} {obj.get('metadata', {}).get('name')}: " + "; ".join(errors)
    # Required fields: the client's deserialiser raises ValueError on a missing required field.
    ApiClient()._ApiClient__deserialize(copy.deepcopy(obj), name)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Loading and rendering
# ---------------------------------------------------------------------------------------------
def load_manifests() -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path in MANIFESTS:
        objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return objects


def render_job_manifest(template: dict[str, Any], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Job the worker would submit: variable defaults (None dropped, as the worker does) plus
    `values`, templated with Prefect's own `apply_values`, then the worker's post-processing."""
    defaults = BaseJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    variables = {**defaults, "name": "train-abc123", **(values or {})}
    config = apply_values(copy.deepcopy(template["job_configuration"]), variables)
    job = config["job_manifest"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    # The worker prepends the flow-run env (PREFECT_API_URL, ...) to a literal env list.
    container["env"] = [{"name": k, "value": v} for k, v in variables.get("env", {}).items()] + container["env"]
    # ... and splits a string command into args (`_populate_command_if_not_present`).
    if isinstance(container.get("args"), str):
        container["args"] = shlex.split(container["args"])
    return job


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    return []


def rendered_jobs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, render_job_manifest(json.loads(p.read_text()))) for p in TEMPLATES]


def update_config(nnodes: int = 3, per_node: int = 8, **update: Any) -> TrainConfig:
    return TrainConfig.model_validate({"update": {"nnodes": nnodes, "world_size": per_node, **update}})


def rendered_update(
    run_uri: str = "s3://ragen-runs/runs/sokoban-qwen-0.5b", iteration: int = 7, config: TrainConfig | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(service, job) of a multi-node update, as the launcher submits them."""
    return k8s_launch.render_manifests(
        run_uri, iteration, config or update_config(), image="ghcr.io/acme/ragen-gpu:abc1234", rdzv_id="example"
    )


def all_pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = [(f"{o['kind']}/{o['metadata']['name']}", s) for o in load_manifests() for s in pod_specs(o)]
    specs += [(name, job["spec"]["template"]["spec"]) for name, job in rendered_jobs()]
    specs += [("update-indexed-job", rendered_update()[1]["spec"]["template"]["spec"])]
    return specs


# ---------------------------------------------------------------------------------------------
# The validator itself must be able to fail
# ---------------------------------------------------------------------------------------------
def test_strict_validator_rejects_unknown_fields_and_wrong_types() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "c", "image": "i", "securityContxt": {}, "ports": [{"containerPort": "80"}]}]},
    }
    errors = strict_errors(pod, "V1Pod")
    assert any("securityContxt: unknown field" in e for e in errors), errors
    assert any("containerPort: expected int" in e for e in errors), errors
    with pytest.raises(ValueError, match="containers"):
        ApiClient()._ApiClient__deserialize({"metadata": {"name": "x"}, "spec": {}}, "V1Pod")  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------
def test_manifest_files_exist() -> None:
    kinds = {o["kind"] for o in load_manifests()}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Deployment", "NetworkPolicy"} <= kinds
    assert [p.name for p in TEMPLATES] == ["base-job-template-cpu.json", "base-job-template-gpu.json"]


@pytest.mark.parametrize("obj", load_manifests(), ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_manifest_validates_strictly(obj: dict[str, Any]) -> None:
    validate_strict(obj)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_rendered_job_template_validates_strictly(path: Path) -> None:
    template = json.loads(path.read_text())
    job = render_job_manifest(
        template, {"image": "registry.example/ragen:abc1234", "command": "python -m prefect.engine"}
    )
    assert not find_placeholders(json.dumps(job)), "unrendered placeholder left in the job manifest"
    pod_spec = job["spec"]["template"]["spec"]
    for key, value in PREFECT_POD_SPEC_QUIRKS.items():
        assert pod_spec.pop(key) == value
    validate_strict(job)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_job_template_follows_prefect_worker_format(path: Path) -> None:
    template = json.loads(path.read_text())
    assert set(template) == {"job_configuration", "variables"}
    config, variables = template["job_configuration"], template["variables"]
    # Keys of the kubernetes worker's job configuration (KubernetesWorkerJobConfiguration).
    allowed = {
        "command", "env", "labels", "name", "namespace", "job_manifest", "cluster_config",
        "job_watch_timeout_seconds", "pod_watch_timeout_seconds", "stream_output",
    }  # fmt: skip
    assert set(config) <= allowed, set(config) - allowed
    assert variables["type"] == "object"
    # Every placeholder names a declared variable.
    used = {p.name for p in find_placeholders(json.dumps(config))}
    assert used <= set(variables["properties"]), used - set(variables["properties"])
    # The worker's required skeleton (prefect_kubernetes.worker._get_base_job_manifest).
    job = config["job_manifest"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["containers"][0]["name"] == "prefect-job"
    for key, value in PREFECT_POD_SPEC_QUIRKS.items():
        assert pod_spec[key] == value


def test_gpu_template_requests_gpus_and_exposes_scheduling_variables() -> None:
    template = json.loads((K8S / "base-job-template-gpu.json").read_text())
    job = render_job_manifest(template, {"gpu_count": "4", "node_selector": {"pool": "a100"}})
    spec = job["spec"]["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "4"
    assert spec["nodeSelector"] == {"pool": "a100"}
    assert spec["tolerations"] == template["variables"]["properties"]["tolerations"]["default"]
    assert spec["serviceAccountName"] == "ragen-job"
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "ragen-s3", "optional": True}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["scratch"]
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"/scratch", "/tmp"} <= mounts


def test_gpu_template_tells_a_launcher_its_image_and_keys_api_access_on_the_service_account() -> None:
    template = json.loads((K8S / "base-job-template-gpu.json").read_text())
    job = render_job_manifest(template, {"image": "ghcr.io/acme/ragen-gpu:abc1234"})
    pod = job["spec"]["template"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env[k8s_launch.IMAGE_ENV] == "ghcr.io/acme/ragen-gpu:abc1234"
    # One knob: the ServiceAccount decides the token (no pod-level override) and, through the pod
    # label, the Kubernetes API egress.
    assert "automountServiceAccountToken" not in pod["spec"]
    policies = {o["metadata"]["name"]: o["spec"] for o in load_manifests() if o["kind"] == "NetworkPolicy"}
    api = policies["allow-launcher-kube-api-egress"]["podSelector"]["matchLabels"]
    for path in TEMPLATES:
        for account, reaches_api in (("ragen-job", False), ("ragen-launcher", True)):
            labels = render_job_manifest(json.loads(path.read_text()), {"service_account_name": account})["spec"][
                "template"
            ]["metadata"]["labels"]
            assert (labels.items() >= api.items()) is reaches_api, (path.name, account)
    accounts = {o["metadata"]["name"]: o for o in load_manifests() if o["kind"] == "ServiceAccount"}
    assert accounts["ragen-job"]["automountServiceAccountToken"] is False
    assert accounts["ragen-launcher"]["automountServiceAccountToken"] is True


def test_cpu_template_requests_no_gpu() -> None:
    job = render_job_manifest(json.loads((K8S / "base-job-template-cpu.json").read_text()))
    assert "nvidia.com/gpu" not in json.dumps(job)


# ---------------------------------------------------------------------------------------------
# Restricted pod-security profile
# ---------------------------------------------------------------------------------------------
_RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                            "persistentVolumeClaim", "projected", "secret"}  # fmt: skip


@pytest.mark.parametrize("name,spec", all_pod_specs(), ids=lambda x: x if isinstance(x, str) else "")
def test_pod_spec_follows_restricted_profile(name: str, spec: dict[str, Any]) -> None:
    pod_sc = spec.get("securityContext", {})
    assert pod_sc.get("runAsNonRoot") is True, name
    assert isinstance(pod_sc.get("runAsUser"), int) and pod_sc["runAsUser"] > 0, name
    assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(flag), f"{name}: {flag}"
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        assert kinds <= _RESTRICTED_VOLUME_TYPES, f"{name}: volume {volume['name']} uses {kinds}"
    containers = spec.get("containers", []) + spec.get("initContainers", [])
    assert containers, name
    for c in containers:
        sc = c.get("securityContext", {})
        where = f"{name} container {c['name']}"
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert not sc.get("capabilities", {}).get("add"), where
        assert not sc.get("privileged"), where
        assert sc.get("runAsUser", 1) != 0, where
        assert sc.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault", where


def test_namespace_enforces_restricted_admission() -> None:
    (ns,) = [o for o in load_manifests() if o["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# ---------------------------------------------------------------------------------------------
# RBAC and network
# ---------------------------------------------------------------------------------------------
def role_verbs(role: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    return {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def named(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in load_manifests() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_worker_role_has_exactly_the_verbs_it_needs() -> None:
    objects = load_manifests()
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Role"} == {
        "prefect-worker",
        "ragen-update-launcher",
    }
    role = named("Role", "prefect-worker")
    got = role_verbs(role)
    assert got == {
        ("batch", "jobs"): ["create", "delete", "get", "list", "watch"],
        ("", "pods"): ["get", "list", "watch"],
        ("", "pods/log"): ["get"],
        ("", "events"): ["list", "watch"],
    }
    assert not any("*" in str(rule) for rule in role["rules"])
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = named("RoleBinding", "prefect-worker")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prefect-worker", "namespace": "ragen"}]
    workers = [o for o in objects if o["kind"] == "Deployment"]
    assert {w["spec"]["template"]["spec"]["serviceAccountName"] for w in workers} == {"prefect-worker"}
    (job_sa,) = [o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "ragen-job"]
    assert job_sa["automountServiceAccountToken"] is False


def test_workers_poll_the_pools_the_templates_define() -> None:
    workers = [o for o in load_manifests() if o["kind"] == "Deployment"]
    pools = set()
    for w in workers:
        args = w["spec"]["template"]["spec"]["containers"][0]["args"]
        pools.add(args[args.index("--pool") + 1])
        assert args[args.index("--type") + 1] == "kubernetes"
    assert pools == {"k8s-gpu", "k8s-cpu"}


def test_launcher_role_has_exactly_the_verbs_the_launcher_calls() -> None:
    """ragen-launcher may run one Indexed Job + Service and explain a failure; nothing more. (The
    launcher's tests check each API call it makes against this Role.)"""
    role = named("Role", "ragen-update-launcher")
    assert role_verbs(role) == {
        ("batch", "jobs"): ["create", "delete"],
        ("batch", "jobs/status"): ["get"],
        ("", "services"): ["create", "delete"],
        ("", "pods"): ["list"],
        ("", "pods/log"): ["get"],
    }
    binding = named("RoleBinding", "ragen-update-launcher")
    assert binding["roleRef"]["name"] == "ragen-update-launcher"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ragen-launcher", "namespace": "ragen"}]


def test_update_rank_policy_opens_rendezvous_and_nccl_ports_between_update_pods_only() -> None:
    policies = {o["metadata"]["name"]: o["spec"] for o in load_manifests() if o["kind"] == "NetworkPolicy"}
    ranks = policies["allow-update-rank-traffic"]
    peers = [{"podSelector": ranks["podSelector"]}]  # same namespace, same role; no ipBlock, no namespaceSelector
    assert ranks["podSelector"] == {"matchLabels": {"ragen.io/role": "update-rank"}}
    assert [r["from"] for r in ranks["ingress"]] == [peers] and [r["to"] for r in ranks["egress"]] == [peers]
    for rule in ranks["ingress"] + ranks["egress"]:
        assert {"protocol": "TCP", "port": k8s_launch.RDZV_PORT} in rule["ports"]
        assert {"protocol": "TCP", "port": 1024, "endPort": 65535} in rule["ports"]
    pod_labels = rendered_update()[1]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels.items() >= ranks["podSelector"]["matchLabels"].items()
    # ... and the update pods reach DNS and S3 like any flow run, but not the Kubernetes API.
    assert pod_labels.items() >= policies["allow-s3-egress"]["podSelector"]["matchLabels"].items()
    api = policies["allow-launcher-kube-api-egress"]["podSelector"]["matchLabels"]
    assert not pod_labels.items() >= api.items()


def test_network_policy_default_denies_and_allows_only_named_egress() -> None:
    policies = {o["metadata"]["name"]: o["spec"] for o in load_manifests() if o["kind"] == "NetworkPolicy"}
    deny = policies.pop("default-deny-all")
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    policies.pop("allow-update-rank-traffic")  # pod-to-pod inside one update: the test above
    ports = set()
    for name, spec in policies.items():
        assert spec["policyTypes"] == ["Egress"], f"{name} must not open ingress"
        assert "ingress" not in spec, name
        for rule in spec["egress"]:
            assert rule.get("to"), f"{name}: an egress rule without 'to' allows every destination"
            assert rule.get("ports"), f"{name}: an egress rule without ports allows every port"
            ports |= {(p["protocol"], p["port"]) for p in rule["ports"]}
    # DNS, Prefect API, S3 (HTTPS / in-cluster MinIO), Kubernetes API: nothing else.
    assert ports == {("UDP", 53), ("TCP", 53), ("TCP", 4200), ("TCP", 443), ("TCP", 9000), ("TCP", 6443)}
    job_labels = {"app.kubernetes.io/part-of": "ragen", "app.kubernetes.io/component": "flow-run"}
    for _, job in rendered_jobs():
        assert job["spec"]["template"]["metadata"]["labels"].items() >= job_labels.items()
    assert policies["allow-s3-egress"]["podSelector"]["matchLabels"] == job_labels


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_job_template_passes_prefect_server_validation(path: Path) -> None:
    """The check the Prefect server runs on `prefect work-pool create --base-job-template`."""
    from prefect.server.schemas.actions import WorkPoolCreate, validate_base_job_template

    template = json.loads(path.read_text())
    validate_base_job_template(template)
    WorkPoolCreate(name="k8s-test", type="kubernetes", base_job_template=template)


# ---------------------------------------------------------------------------------------------
# Multi-node update: Indexed Job + headless Service (ragen_tasks.training.k8s_launch)
# ---------------------------------------------------------------------------------------------
def test_update_job_and_service_validate_strictly() -> None:
    service, job = rendered_update()
    validate_strict(service)
    validate_strict(job)
    assert [o["kind"] for o in yaml.safe_load_all(UPDATE_EXAMPLE.read_text())] == ["Service", "Job"]
    for obj in yaml.safe_load_all(UPDATE_EXAMPLE.read_text()):
        validate_strict(obj)


def test_update_job_is_an_indexed_job_behind_a_headless_service() -> None:
    service, job = rendered_update(config=update_config(nnodes=4, per_node=0, gpus_per_node=8, scratch_pvc="rwx"))
    name = job["metadata"]["name"]
    assert service["metadata"]["name"] == name and job["metadata"]["namespace"] == "ragen"
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 7200
    assert pod["subdomain"] == name  # pods resolve as <name>-<index>.<name>
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "64Gi"
    # The GPU work-pool template's identity, credentials and scheduling.
    gpu = render_job_manifest(json.loads((K8S / "base-job-template-gpu.json").read_text()))["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == gpu["serviceAccountName"] == "ragen-job"
    assert pod["automountServiceAccountToken"] is False
    assert container["envFrom"] == gpu["containers"][0]["envFrom"]
    assert (pod["nodeSelector"], pod["tolerations"]) == (gpu["nodeSelector"], gpu["tolerations"])
    assert pod["securityContext"] == gpu["securityContext"]
    assert container["securityContext"] == gpu["containers"][0]["securityContext"]
    # The shared checkpoint scratch (RWX claim) at $RAGEN_SCRATCH, and a memory-backed /dev/shm.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert volumes[mounts[env["RAGEN_SCRATCH"]]]["persistentVolumeClaim"] == {"claimName": "rwx"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    (pvc,) = [o for o in load_manifests() if o["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == TrainConfig().update.scratch_pvc
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_update_job_runs_torchrun_with_c10d_rendezvous_on_pod_0(tmp_path: Path) -> None:
    run_uri, iteration = "s3://ragen-runs/runs/exp-1", 12  # passed as $1 / $2, never spliced into the script
    service, job = rendered_update(run_uri, iteration, update_config(nnodes=3, per_node=4))
    name = job["metadata"]["name"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"] and command[3:] == ["ragen-update-rank", run_uri, "12"]
    assert "$(" not in command[2]  # Kubernetes expands $(VAR) in a command
    # Run the script with stand-ins: getent resolves, python prints the argv it got.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    for index, is_host in (("0", "1"), ("2", "0")):
        out = subprocess.run(
            command, env={**env, "JOB_COMPLETION_INDEX": index}, capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()
        assert out == [
            "-m", "torch.distributed.run",
            "--nnodes=3", "--nproc-per-node=4",
            "--rdzv-backend=c10d", "--rdzv-id=example", "--max-restarts=0",
            f"--rdzv-endpoint={name}-0.{service['metadata']['name']}:{k8s_launch.RDZV_PORT}",
            f"--rdzv-conf=is_host={is_host},join_timeout=900,read_timeout=300",
            "-m", "ragen_tasks.pipeline.update_ranks", run_uri, "12",
        ]  # fmt: skip
    # Without the Indexed Job's index the script refuses to start.
    missing = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "JOB_COMPLETION_INDEX" in missing.stderr
    # A rendezvous host that never resolves fails within the timeout, saying so.
    (bin_dir / "getent").write_text("#!/bin/sh\nexit 2\n")
    slow = rendered_update(run_uri, iteration, update_config(rendezvous_timeout_s=1))[1]
    failed = subprocess.run(
        slow["spec"]["template"]["spec"]["containers"][0]["command"],
        env={**env, "JOB_COMPLETION_INDEX": "1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert failed.returncode == 1 and "did not resolve within 1 s" in failed.stderr


@pytest.mark.parametrize(
    "run_id",
    ["a", "exp1", "Sokoban_Qwen2.5-0.5B.lr1e-5", "X" * 128, "9" + "_." * 40 + "z", "a-" * 64],
)
def test_update_job_names_are_dns_labels(run_id: str) -> None:
    run_uri = f"s3://bucket/some/prefix/{run_id}"
    for iteration in (0, 999_999):
        name = k8s_launch.job_name(run_uri, iteration)
        assert DNS_1035.fullmatch(name) and len(name) <= k8s_launch.MAX_NAME, name
        assert len(f"{name}-{999}-abcde") <= 63  # pod name of index 999; hostname <name>-<index> is shorter
        assert name == k8s_launch.job_name(run_uri + "/", iteration)  # stable across retries
    assert k8s_launch.job_name(run_uri, 1) != k8s_launch.job_name(run_uri, 2)
    assert k8s_launch.job_name(run_uri, 1) != k8s_launch.job_name(f"s3://bucket/other/{run_id}", 1)


def test_update_job_names_refuse_unsafe_run_ids() -> None:
    for bad in ("s3://bucket/runs/..", "s3://bucket/runs/-x", "s3://bucket/runs/a b"):
        with pytest.raises(ValueError, match="run_id"):
            k8s_launch.job_name(bad, 1)


def example_text() -> str:
    """k8s/examples/update-indexed-job.yaml: what the launcher submits for one update (regenerate
    with `python tests/deploy/test_k8s_manifests.py`)."""
    header = (
        "# What ragen_tasks.training.k8s_launch submits for one multi-node update (update.nnodes=3,\n"
        "# update.world_size=8): an example, not applied by hand. Regenerated by\n"
        "#   python tests/deploy/test_k8s_manifests.py\n"
        "# and checked by tests/deploy/test_k8s_manifests.py (strict schema, restricted profile).\n"
    )

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:  # the script as a readable block
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return header + yaml.dump_all(rendered_update(), Dumper=Dumper, sort_keys=False, width=120)


def test_update_job_example_is_what_the_launcher_renders() -> None:
    assert UPDATE_EXAMPLE.read_text() == example_text(), "regenerate: python tests/deploy/test_k8s_manifests.py"


if __name__ == "__main__":
    UPDATE_EXAMPLE.parent.mkdir(exist_ok=True)
    UPDATE_EXAMPLE.write_text(example_text())
