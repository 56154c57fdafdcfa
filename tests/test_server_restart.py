"""``prefixcache serve`` on its default settings, as an operator runs it: a prompt, a
graceful stop (SIGTERM), a restart over the same directory, the same prompt again: the
restarted server serves at least 95 % of it from the cache, exactly what it computed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from engine_support import MODEL_ID, MODELS_DIR, model
from redis_server import free_port

SYSTEM = (
    "You are the help desk of a company that rents out snow ploughs. Answer in one sentence. "
    "Rentals start at nine in the morning and end at five; a late return costs one extra day; "
    "fuel is included; the deposit is refunded within three working days. "
) * 8

pytestmark = pytest.mark.model


class Serve:
    """``prefixcache serve`` in ``workdir`` on a free port, settings from the environment only."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Serve:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
        env |= {"PREFIXCACHE_SERVER_PORT": str(self.port), "PREFIXCACHE_MODEL_MODELS_DIR": str(MODELS_DIR)}
        command = [str(Path(sys.executable).parent / "prefixcache"), "serve"]
        log = (self.workdir / f"serve-{self.port}.log").open("w")
        self.proc = subprocess.Popen(
            command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.workdir / f"serve-{self.port}.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not come up")

    def ask(self) -> tuple[int, int, str]:
        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="local")
        reply = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is fuel included?"}],
            max_tokens=8,
            temperature=0,
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return (
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0,
            reply.choices[0].message.content or "",
        )

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def test_a_restarted_server_hits_on_what_it_computed_before_it_stopped(tmp_path: Path) -> None:
    model()  # converted once for the whole test session (the server reads MODELS_DIR)
    first = Serve(tmp_path).start()
    try:
        prompt, cached, answer = first.ask()
        assert cached == 0 and prompt > 400
    finally:
        # graceful: the queued writes are flushed to the disk tier (uvicorn then re-raises SIGTERM)
        assert first.stop() in (0, -signal.SIGTERM)
    assert any((tmp_path / ".prefixcache" / "disk" / "blocks").rglob("*.blk"))
    second = Serve(tmp_path).start()
    try:
        again, cached, answer_again = second.ask()
    finally:
        second.stop()
    assert again == prompt
    assert cached >= 0.95 * prompt, (cached, prompt)
    assert answer_again == answer  # greedy, from the restarted cache's KV: the same answer
    first_log, second_log = ((tmp_path / f"serve-{s.port}.log").read_text() for s in (first, second))
    assert "event=cache_flushed" in first_log, first_log[-3000:]  # the stop and the restart say so in the log
    opened = re.search(r"event=tier_opened tier=disk path=\S+ blocks=(\d+)", second_log)
    assert opened is not None and int(opened.group(1)) * 16 >= 0.95 * prompt, second_log[-3000:]
