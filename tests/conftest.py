"""Shared pytest fixtures. Tests never reach the network: only 127.0.0.1."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from test servers
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download a model


# --- S3 API on loopback (moto), shared by data and flows tests ------------------------------------
import socket as _socket

import pytest as _pytest


@_pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto's threaded server) on 127.0.0.1:<free port>, with fake credentials.

    Sets AWS_ENDPOINT_URL and fake AWS_* variables for the session (restored afterwards) and yields
    the endpoint URL. Create buckets with boto3 against it; ``s3://`` stores pick it up from the env.
    """
    from moto.server import ThreadedMotoServer

    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    with _pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        try:
            yield endpoint
        finally:
            server.stop()
