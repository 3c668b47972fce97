"""A flow that does nothing but finish: what the schedule test deploys (it must start in a second)."""

from prefect import flow


@flow(name="ragen-ping")
def ping() -> str:
    return "pong"
