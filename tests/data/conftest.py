"""Fixtures of the data-plane tests: stores on a temp folder and on the loopback S3 server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh, empty bucket on the moto server; returns its name."""
    import boto3

    name = f"ragen-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["file", "s3"])
def store_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store root on file:// and on s3:// (moto), so each test runs against both backends."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs"
