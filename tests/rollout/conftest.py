"""Fixtures for rollout tests: a toy game, and a small vLLM-like OpenAI-compatible server on
127.0.0.1 (the ``chatml_tokenizer`` fixture lives in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ragen_tasks.envs.base import TextGame, canonical_action

# ---------------------------------------------------------------------------------------------
# A tiny TextGame for loop tests (independent of the real games).


class LineWalk(TextGame):
    """Walk on a line of ``size`` cells from P to G. Reward 1 at G (terminated, success)."""

    name = "line_walk"

    def __init__(self, size: int = 6, max_actions_per_episode: int = 10) -> None:
        self.size = size
        self.max_actions = max_actions_per_episode
        self.pos = self.goal = self.used = 0

    @property
    def action_names(self) -> tuple[str, ...]:
        return ("Left", "Right")

    @property
    def legend(self) -> Mapping[str, str]:
        return {"P": "player", "G": "goal", "_": "empty"}

    def render(self) -> str:
        return "".join("P" if i == self.pos else "G" if i == self.goal else "_" for i in range(self.size))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos, self.goal = (int(x) for x in self.np_random.choice(self.size, size=2, replace=False))
        self.used = 0
        return self.render(), {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        name = canonical_action(action, self.action_names)
        if name is None:
            return (
                self.render(),
                0.0,
                False,
                False,
                {"action_is_valid": False, "action_is_effective": False, "success": False},
            )
        old = self.pos
        self.pos = max(0, self.pos - 1) if name == "Left" else min(self.size - 1, self.pos + 1)
        self.used += 1
        success = self.pos == self.goal
        info = {"action_is_valid": True, "action_is_effective": self.pos != old, "success": success}
        return self.render(), 1.0 if success else 0.0, success, (not success) and self.used >= self.max_actions, info


def line_walk_factory(name: str, config: Mapping[str, Any]) -> TextGame:
    assert name == "line_walk", name
    return LineWalk(**dict(config))


@pytest.fixture
def line_walk() -> Any:
    return line_walk_factory


# ---------------------------------------------------------------------------------------------
# A vLLM-like OpenAI-compatible server for engine tests (127.0.0.1 only).


class FakeVLLM:
    """Answers /v1/completions like vLLM. ``mode`` picks the behaviour; ``bodies`` records requests."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.mode = "token_id_strings"
        self.reply_ids: list[int] | None = None  # fixed reply (e.g. an encoded answer); else derived
        self.reply_text = ""
        # a sampler double: reply reply_choices[seed % len] (text, ids), so a reply depends on the seed
        self.reply_choices: list[tuple[str, list[int]]] | None = None
        self.lock = threading.Lock()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.bodies.append(body)
        if self.mode == "error":
            return 500, {"error": "boom"}
        if self.mode == "slow":
            time.sleep(1.0)
        prompt = body["prompt"]
        if self.reply_choices is not None:
            self.reply_text, self.reply_ids = self.reply_choices[int(body["seed"]) % len(self.reply_choices)]
        ids = self.reply_ids or [(prompt[-1] + k + 1) % 50 for k in range(min(3, body["max_tokens"]))]
        ids = ids[: body["max_tokens"]]
        finish = "length" if len(ids) == body["max_tokens"] and self.reply_ids is None else "stop"
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.reply_text or "x" * len(ids),
            "finish_reason": finish,
            "stop_reason": "</answer>" if self.mode != "eos" else None,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": [-0.1 * (k + 1) for k in range(len(ids))],
            },
        }
        if self.mode == "token_ids_field":
            choice["token_ids"] = ids
            choice["logprobs"]["tokens"] = ["?" for _ in ids]
        if self.mode == "bad":
            del choice["logprobs"]
        return 200, {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


@contextlib.contextmanager
def serve(fake: FakeVLLM) -> Iterator[str]:
    """Serve ``fake`` on 127.0.0.1 (a free port) while the block runs; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/completions", self.path
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, payload = fake.answer(body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError):  # the client gave up (timeout test)
                self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server() -> Iterator[tuple[str, FakeVLLM]]:
    """One fake server: (base URL, its FakeVLLM)."""
    fake = FakeVLLM()
    with serve(fake) as url:
        yield url, fake


@pytest.fixture
def servers() -> Iterator[Callable[[int], list[tuple[str, FakeVLLM]]]]:
    """``servers(n)`` starts n more fake servers (all stopped at the end of the test)."""
    with contextlib.ExitStack() as stack:

        def start(n: int) -> list[tuple[str, FakeVLLM]]:
            fakes = [FakeVLLM() for _ in range(n)]
            return [(stack.enter_context(serve(fake)), fake) for fake in fakes]

        yield start
