"""Shared pytest fixtures and settings. Tests never reach the network: only 127.0.0.1."""

import os

# Set before anything imports transformers / prefect (both read these at import time).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from test servers
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download a model

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# --- a small ChatML tokenizer (byte-level BPE trained in-process, well under a second) -----------
# for agent and rollout tests that must not depend on the model presets
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "<think>I should move Left then Up</think><answer>Left || Up || Right || Down</answer>",
    "Board:\n#####\n#_P_#\n#_X_#\n#_O_#\n##### Reward: 0. Actions left: 3. Symbols: P = player",
]


def build_chatml_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


@pytest.fixture(scope="session")
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return build_chatml_tokenizer()


# --- S3 API on loopback (moto), shared by data and flows tests ------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto's threaded server) on 127.0.0.1:<free port>, with fake credentials.

    Sets AWS_ENDPOINT_URL and fake AWS_* variables for the session (restored afterwards) and yields
    the endpoint URL. Create buckets with boto3 against it; ``s3://`` stores pick it up from the env.
    """
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
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
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        try:
            yield endpoint
        finally:
            server.stop()


def stop_process(proc: subprocess.Popen[Any], *, timeout: float) -> None:
    """Stop a helper process the tests started (a server, a worker, a browser): terminate, and kill
    it if it is still there after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- Prefect: flow tests run against a real (temporary, local) API via Prefect's test harness -----


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# Smallest settings that still exercise every stage (warm start, filter, GX, update, eval).
TINY_RUN = {
    "rollout.groups": 4,
    "rollout.group_size": 4,
    "warm_start.episodes_per_env": 16,
    "warm_start.steps": 4,
    "warm_start.batch_size": 8,
    "eval.seeds": 4,
    "eval.every": 1,
    "agent.max_turns": 2,
    "agent.max_tokens_per_turn": 24,
    "optim.minibatch_size": 16,
    "optim.micro_batch_size": 16,
}


# --- two checkpoints for the regression gate: a warm-started one and an untrained one -----------
# The warm start teaches the answer format, so about half of the Bandit seeds succeed (the demos pick
# an arm at random); without it the model never answers in format and succeeds on none. Seconds each.
GATE_SEEDS = 24


def make_gate_checkpoint(root: str, run_id: str, *, trained: bool) -> str:
    """Committed checkpoint 0 of a bandit-tiny run under store ``root`` (a folder or s3://...); its URI."""
    from ragen_tasks import pipeline
    from ragen_tasks.presets import load_config

    warm = {"warm_start.steps": 60, "warm_start.episodes_per_env": 64} if trained else {"warm_start.enabled": False}
    config = load_config("bandit-tiny", {**TINY_RUN, **warm, "store.root": root})
    run = pipeline.open_run(config, run_id)
    pipeline.init_run(run)
    local = run.checkpoint_path(0)
    return str(local) if run.is_local else f"{run.uri}/checkpoints/{local.name}"


@pytest.fixture(scope="session")
def gate_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("gate") / "runs")
    return {
        "good": make_gate_checkpoint(root, "gate-good", trained=True),
        "damaged": make_gate_checkpoint(root, "gate-damaged", trained=False),
    }
