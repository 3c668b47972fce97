"""Stage deployments end to end on one machine: a local Prefect server (the test harness), a
``process`` work pool, a real worker process on 127.0.0.1, and the trainer side of
``rollout.mode=deployment`` (``flows/stages.py:rollout_via_deployment``) running the rollout stage
as a deployment that receives only the run's store URI and the iteration number.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_tasks import pipeline
from tests.conftest import TINY_RUN, stop_process

ROOT = Path(__file__).resolve().parents[2]
POOL = "stage-test-process"


async def _setup_pool_and_deployments() -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.flows import load_flow_from_entrypoint

    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
        ids = {}
        for name, entry in (
            ("rollout-stage", "flows/stages.py:rollout_stage"),
            ("update-stage", "flows/stages.py:update_stage"),
        ):
            flow = load_flow_from_entrypoint(str(ROOT / entry))
            flow_id = await client.create_flow_from_name(flow.name)
            ids[name] = str(
                await client.create_deployment(
                    flow_id=flow_id, name=name, entrypoint=entry, path=str(ROOT), work_pool_name=POOL
                )
            )
        return ids


async def _flow_run_states(deployment_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async with get_client() as client:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        return [r.state.type.value if r.state else "NONE" for r in runs]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_rollout_stage_runs_as_a_deployment_on_a_process_worker(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    ids = asyncio.run(_setup_pool_and_deployments())
    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "HF_HUB_OFFLINE": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PYTHONPATH": str(ROOT),
    }
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        from prefect import flow

        from flows import stages
        from ragen_tasks.presets import load_config

        config = load_config(
            "bandit-tiny",
            {
                **TINY_RUN,
                "iterations": 1,
                "warm_start.enabled": False,
                "eval.seeds": 1,
                "rollout.mode": "deployment",
                "rollout.stage_timeout_s": 180,
                "store.root": str(tmp_path / "runs"),
            },
        )
        run = pipeline.open_run(config, "stages")
        pipeline.init_run(run)
        pipeline.generate_tasks(run, 0)

        @flow(name="stage-deployment-test")
        def trainer_side() -> dict[str, object]:
            return stages.rollout_via_deployment(run.uri, 0)  # only the run URI + iteration cross over

        rolled = trainer_side()
    except Exception:
        print(log.read_text()[-4000:])
        raise
    finally:
        stop_process(worker, timeout=20)
    # The rollout ran once, as its deployment, in the worker's process, and committed to the store.
    assert asyncio.run(_flow_run_states(ids["rollout-stage"])) == ["COMPLETED"]
    assert run.store.has_manifest(run.run_id, 0, "rollouts")
    assert rolled["trajectories"] == config.rollout.groups * config.rollout.group_size
    assert run.store.read_manifest(run.run_id, 0, "rollouts").policy_version == 0
