"""A page in real headless Chromium, driven over the DevTools protocol (no extra package: websockets
comes with Prefect). For tests that must see what a person's browser shows: does it load, do its
images decode, what reaches the console.

    with Page.open(Path("report.html").as_uri()) as page:
        page.evaluate("document.images.length"), page.errors
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.sync.client import ClientConnection, connect

from tests.conftest import stop_process

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    """The Chromium executable on PATH (Debian's package: `apt-get install chromium`), if any."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class Page:
    """One tab of a fresh headless Chromium (its own profile), closed on exit."""

    def __init__(self, proc: subprocess.Popen[bytes], profile: str, ws: ClientConnection) -> None:
        self._proc, self._profile, self._ws = proc, profile, ws
        self._ids = itertools.count(1)
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads

    @classmethod
    def open(cls, url: str, *, timeout: float = 60.0) -> Page:
        exe = chromium()
        if exe is None:
            raise FileNotFoundError("Chromium is not installed (apt-get install chromium)")
        profile = tempfile.mkdtemp(prefix="ragen-chromium-")
        log = Path(profile) / "stderr.log"  # a file, not a pipe: a chatty browser never blocks on it
        with log.open("w") as sink:
            proc = subprocess.Popen(
                [
                    exe,
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",
                    f"--user-data-dir={profile}",
                    "about:blank",
                ],
                stdout=subprocess.DEVNULL,
                stderr=sink,
            )
        deadline = time.monotonic() + timeout
        port = None
        while port is None and time.monotonic() < deadline:
            if match := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", log.read_text()):
                port = int(match.group(1))
            elif proc.poll() is not None:
                raise RuntimeError(f"Chromium exited with {proc.returncode}: {log.read_text()[-2000:]}")
            else:
                time.sleep(0.2)
        if port is None:
            proc.kill()
            raise TimeoutError("Chromium did not open its DevTools port")
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        (tab,) = [t for t in targets if t["type"] == "page"][:1]
        page = cls(proc, profile, connect(tab["webSocketDebuggerUrl"], max_size=2**26))
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Page.navigate", url=url)
        page.wait_for("Page.loadEventFired", timeout)
        return page

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events arriving meanwhile are scanned for errors."""
        call_id = next(self._ids)
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=60))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._note(message)

    def wait_for(self, event: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            self._note(message)
            if message.get("method") == event:
                return
        raise TimeoutError(f"no {event} within {timeout} s")

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Network.loadingFailed":
            self.errors.append(f"load failed: {params.get('errorText')}")

    def __enter__(self) -> Page:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._ws.close()
        stop_process(self._proc, timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)
