"""prefect.yaml: parses with Prefect's own model, names known pools, resolves its templates and
entrypoints, and keeps the nightly training schedule registered inactive.

Offline only: nothing is deployed or built here. The entrypoint checks load each flow the way
`prefect deploy` does (`load_flow_from_entrypoint`) and are skipped, with the reason, while the
flow file does not exist yet.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = ROOT / "prefect.yaml"
POOL_TEMPLATES = {
    "k8s-gpu": ROOT / "k8s" / "base-job-template-gpu.json",
    "k8s-cpu": ROOT / "k8s" / "base-job-template-cpu.json",
}
KNOWN_POOLS = {"local-process", *POOL_TEMPLATES}
ENTRYPOINT = re.compile(r"^flows/[a-z_]+\.py:[a-z_]+$")


def load() -> dict[str, Any]:
    data = yaml.safe_load(PREFECT_YAML.read_text())
    assert isinstance(data, dict)
    return data


def deployments() -> list[dict[str, Any]]:
    return list(load()["deployments"])


def by_name(name: str) -> dict[str, Any]:
    (dep,) = [d for d in deployments() if d["name"] == name]
    return dep


def step_body(step: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    ((fn, body),) = step.items()
    return fn, body


def test_parses_with_prefects_own_model() -> None:
    models = pytest.importorskip("prefect.cli.deploy._models", reason="Prefect moved its prefect.yaml model")
    raw = load()
    model = models.PrefectYamlModel.model_validate(raw)
    assert len(model.deployments) == len(raw["deployments"])
    allowed = set(models.DeploymentConfig.model_fields)
    for dep in raw["deployments"]:
        # DeploymentConfig ignores unknown keys: a typo would be silently dropped, so check here.
        assert set(dep) <= allowed, f"{dep['name']}: unknown keys {set(dep) - allowed}"
        for schedule in dep.get("schedules") or []:
            models.RawScheduleConfig.model_validate(schedule)  # extra="forbid"


def test_expected_deployments_on_known_pools() -> None:
    names = [d["name"] for d in deployments()]
    assert len(names) == len(set(names))
    assert {"train", "evaluate", "regression-eval", "rollout-worker"} <= set(names)
    for dep in deployments():
        assert dep["work_pool"]["name"] in KNOWN_POOLS, dep["name"]
        assert ENTRYPOINT.match(dep["entrypoint"]), f"{dep['name']}: entrypoint {dep['entrypoint']!r}"
    assert by_name("train")["work_pool"]["name"] == "k8s-gpu"
    assert by_name("rollout-worker")["work_pool"]["name"] == "k8s-gpu"
    assert {d["work_pool"]["name"] for d in deployments()} == KNOWN_POOLS


def test_definitions_anchor_the_pools() -> None:
    pools = load()["definitions"]["work_pools"]
    assert {p["name"] for p in pools.values()} == KNOWN_POOLS
    # yaml anchors resolve to the same mapping, so a deployment's pool *is* a definition.
    assert all(any(d["work_pool"] == p for p in pools.values()) for d in deployments())


def test_nightly_training_schedule_is_registered_inactive() -> None:
    schedules_mod = pytest.importorskip("prefect.cli.deploy._schedules", reason="Prefect moved its schedule builder")
    (schedule,) = by_name("train")["schedules"]
    built = schedules_mod._schedule_config_to_deployment_schedule(schedule)
    assert built["active"] is False
    assert built["schedule"].cron == "0 2 * * *"
    for dep in deployments():
        if dep["name"] != "train":
            assert not dep.get("schedules"), f"{dep['name']} should run on demand only"


IMAGE_VARIABLE = re.compile(r"^\{\{ prefect\.variables\.ragen_image_(cpu|gpu|vllm) \}\}$")


def test_deploying_builds_nothing_and_installs_nothing() -> None:
    """`prefect deploy --all` must work on a machine without Docker: no build or push steps, and no
    step `requires:` a package (Prefect would pip-install it into the user's environment)."""
    data = load()
    assert data.get("build") == [] and data.get("push") == [], (
        "top-level build/push steps would run for every deployment"
    )
    for dep in deployments():
        assert not dep.get("build") and not dep.get("push"), f"{dep['name']}: deploying must not build or push"
    assert "requires:" not in PREFECT_YAML.read_text()


@pytest.mark.parametrize(
    "dep", [d for d in deployments() if d["work_pool"]["name"] in POOL_TEMPLATES], ids=lambda d: d["name"]
)
def test_cluster_deployment_runs_the_image_named_by_its_prefect_variable(dep: dict[str, Any]) -> None:
    job_variables = dep["work_pool"]["job_variables"]
    match = IMAGE_VARIABLE.match(job_variables["image"])
    assert match, f"{dep['name']}: image {job_variables['image']!r} is not a ragen_image_* Prefect variable"
    kind = match.group(1)
    assert (ROOT / "docker" / f"Dockerfile.{kind}").is_file()
    # `make images` builds and pushes that image and sets the variable.
    makefile = (ROOT / "Makefile").read_text()
    loop = re.search(r"for kind in ([a-z ]+);", makefile)
    assert loop and kind in loop.group(1).split(), "make images does not build this image"
    assert "prefect variable set ragen_image_$$kind" in makefile
    # Every job variable is one the pool's base job template declares.
    template = json.loads(POOL_TEMPLATES[dep["work_pool"]["name"]].read_text())
    assert set(job_variables) <= set(template["variables"]["properties"])


def test_every_deployment_names_its_own_pull_step() -> None:
    """An ad-hoc deployment inherits the top-level pull step: the local checkout, never the image's /opt/ragen."""
    data = load()
    assert data["pull"] == data["definitions"]["pull"]["local_checkout"]
    image_dir = data["definitions"]["pull"]["in_image"][0]["prefect.deployments.steps.set_working_directory"][
        "directory"
    ]
    for dockerfile in (ROOT / "docker").glob("Dockerfile.*"):
        assert f"WORKDIR {image_dir}" in dockerfile.read_text(), dockerfile.name
    for dep in deployments():
        (step,) = dep["pull"]
        fn, body = step_body(step)
        assert fn == "prefect.deployments.steps.set_working_directory", dep["name"]
        local = dep["work_pool"]["name"] == "local-process"
        assert body["directory"] == ("{{ $RAGEN_HOME }}" if local else image_dir), dep["name"]


def test_local_deployments_mirror_train_evaluate_and_the_gate() -> None:
    local = {d["entrypoint"] for d in deployments() if d["work_pool"]["name"] == "local-process"}
    assert local == {"flows/train.py:train", "flows/evaluate.py:evaluate", "flows/evaluate.py:regression_eval"}
    assert by_name("train-local")["concurrency_limit"] == 1


@pytest.mark.parametrize("dep", deployments(), ids=lambda d: d["name"])
def test_entrypoint_resolves_to_a_flow_accepting_the_parameters(dep: dict[str, Any]) -> None:
    path, func = dep["entrypoint"].split(":")
    if not (ROOT / path).is_file():
        pytest.skip(f"{path} does not exist yet (the flows are written separately); enabled once it does")
    from prefect.flows import Flow, load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    flow = load_flow_from_entrypoint(str(ROOT / dep["entrypoint"]))
    assert isinstance(flow, Flow), f"{dep['entrypoint']} is not a @flow"
    assert flow.fn.__name__ == func
    schema = parameter_schema(flow)
    properties = set(schema.properties)
    given = set(dep.get("parameters") or {})
    for schedule in dep.get("schedules") or []:
        given |= set(schedule.get("parameters") or {})
    assert given <= properties, f"{dep['name']}: parameters {given - properties} not in the flow signature"
    # Typed parameters, so the UI renders a form: every property has a type (or a $ref / anyOf).
    for name, prop in schema.properties.items():
        assert {"type", "$ref", "anyOf", "allOf"} & set(prop), f"{dep['name']}.{name} has no type"
