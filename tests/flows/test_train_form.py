"""The train flow as the Prefect UI's run form shows it: every parameter typed and described, the
preset a choice among the shipped presets, the common knobs as fields of their own, and errors in
the form's words; a deployment run without a run id gets one that its retries keep."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema

from flows.evaluate import evaluate, regression_eval
from flows.train import stable_run_id, train
from ragen_tasks.config import ConfigError
from ragen_tasks.presets import available_presets, load_config


@pytest.mark.parametrize("flow", [train, evaluate, regression_eval], ids=lambda f: f.name)
def test_every_parameter_is_typed_and_described(flow) -> None:  # type: ignore[no-untyped-def]
    schema = parameter_schema(flow).model_dump_for_openapi()
    for name, prop in schema["properties"].items():
        assert prop.get("description"), f"{flow.name}.{name} has no description in the form"
        assert {"type", "anyOf", "$ref", "allOf"} & set(prop), f"{flow.name}.{name} has no type"


def test_the_train_form() -> None:
    props = parameter_schema(train).model_dump_for_openapi()["properties"]
    assert props["preset"]["enum"] == available_presets() and props["preset"]["default"] == "default"
    assert {"iterations", "seed", "eval_seeds", "run_id", "store_root", "overrides"} <= set(props)
    assert "show_progress" not in props, "a field that does nothing in a deployment"
    assert props["overrides"]["examples"] == [{"optim.lr": 1e-4, "rollout.groups": 8, "eval.every": 5}]
    assert "^" in str(props["run_id"]) and "minimum" in str(props["iterations"])


@pytest.mark.usefixtures("prefect_api")
def test_bad_values_fail_at_once_in_the_forms_words(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"overrides\['iteratons'\]: unknown key 'iteratons'"):
        train(preset="bandit-tiny", overrides={"iteratons": 3}, store_root=str(tmp_path))
    with pytest.raises(ConfigError, match="overrides sets 'iterations', which has a field of its own"):
        train(preset="bandit-tiny", iterations=2, overrides={"iterations": 3}, store_root=str(tmp_path))
    assert time.monotonic() - t0 < 30, "validation must come before any heavy work"
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"


def test_a_deployment_run_without_run_id_keeps_its_id_across_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config("bandit-tiny")
    assert stable_run_id(config) is None  # `ragen train`: named by the preset and the time, as before
    # Inside a deployment's flow run (Prefect's runtime reads these overrides; a retry keeps id and name).
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "5f0c1b3e-0000-4000-8000-000000000001")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__ID", "a1b2c3d4-0000-4000-8000-000000000002")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "brave-otter")
    assert stable_run_id(config) == stable_run_id(config) == "bandit-tiny-brave-otter-a1b2c3d4"
    named = load_config("bandit-tiny", {"run_id": "mine"})
    assert stable_run_id(named) == "mine"
