"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in NUL on file descriptors 3 and 4), for tests that must type into a
page, read its cookies or wait for it, which ``--dump-dom`` cannot."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from test_ops_dashboard_page import HEADLESS, chromium


def _high(fd: int) -> int:
    """``fd`` moved above 4 (close-on-exec), so that placing the pipes on 3 and 4 clobbers neither."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, profile: Path, window: tuple[int, int] = (1280, 1000)) -> None:
        browser = chromium()
        assert browser is not None
        to_browser_r, self._to_browser = map(_high, os.pipe())
        self._from_browser, from_browser_w = map(_high, os.pipe())
        flags = [
            *HEADLESS,
            "--hide-scrollbars",
            f"--window-size={window[0]},{window[1]}",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
        ]

        def wire() -> None:  # the child reads commands on fd 3 and answers on fd 4 (dup2 keeps them across exec)
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.log = profile.parent / "chromium.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [browser, *flags, "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                close_fds=False,  # the pipes' own descriptors close on exec; 3 and 4 stay
                preexec_fn=wire,
            )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer, self._next_id, self.console = b"", 0, []
        pages = [t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        attached = self.send("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)
        self._session = attached["sessionId"]
        self.send("Runtime.enable", session=True)
        self.send("Page.enable", session=True)

    def send(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Call ``method`` (on the page when ``session``) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result
            if reply.get("method") in ("Runtime.consoleAPICalled", "Runtime.exceptionThrown"):
                self.console.append(reply["params"])

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the pipe: " + self.log.read_text(errors="replace")[-2000:])
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: dict[str, Any] = json.loads(message)
        return parsed

    def open(self, url: str) -> None:
        self.send("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete'")

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise)."""
        result = self.send(
            "Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 20) -> None:
        deadline = time.monotonic() + seconds
        while not self.js(f"!!({expression})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} was still false after {seconds} s")
            time.sleep(0.05)

    def cookies(self) -> list[dict[str, Any]]:
        cookies: list[dict[str, Any]] = self.send("Network.getAllCookies", session=True)["cookies"]
        return cookies

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", session=True)["data"]))

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.send("Browser.close")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
