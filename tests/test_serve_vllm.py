"""``prefixcache serve-vllm`` without vLLM: the two command lines it plans, where the
tenant secret goes (each child's environment, under the name it reads; never a command
line), and the supervisor, over stand-in children that serve ``/health``."""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.fleet.serve_vllm import (
    ROUTER_KEY_ENV,
    ROUTER_SECRET_ENV,
    VLLM_KEY_ENV,
    Options,
    Plan,
    build_plan,
    tenant_secret,
)
from prefixcache.fleet.stamping import route_secret
from prefixcache.fleet.supervisor import GRACE_S
from prefixcache.fleet.zmq import VllmSource
from prefixcache.identity import SECRET_ENV
from prefixcache.integrations.vllm.settings import ConnectorSettings, parse_settings, read_secret
from prefixcache.settings import Settings, load_settings

SECRET = "configured-secret-0123456789"
KEYS = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}


def settings_file(tmp_path: Path, secret: str = SECRET, isolation: str = "partitioned") -> Path:
    keys = ", ".join(f'"{k}" = "{t}"' for k, t in KEYS.items())
    path = tmp_path / "prefixcache.toml"
    text = f"[auth]\napi_keys = {{{keys}}}\n" + (f'tenant_secret = "{secret}"\n' if secret else "")
    path.write_text(text + f'[cache]\nisolation = "{isolation}"\n[model]\nid = "smollm2"\n')
    return path


def options(tmp_path: Path, gpu: bool = False, **extra: object) -> Options:
    base: dict[str, object] = dict(
        model=str(tmp_path / "model"),
        host="127.0.0.1",
        port=8100,
        vllm_port=9101,
        events_dir=tmp_path / "events",
        disk=str(tmp_path / "disk"),
        gpu=gpu,
        config=str(tmp_path / "prefixcache.toml"),
    )
    return Options(**(base | extra))  # type: ignore[arg-type]


def plan_of(tmp_path: Path, gpu: bool = False, environ: dict[str, str] | None = None) -> tuple[Settings, Plan]:
    settings = load_settings(settings_file(tmp_path), env={})
    return settings, build_plan(settings, options(tmp_path, gpu), SECRET, environ or {})


def flag(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_vllm_listens_on_loopback_only_with_the_connector_and_its_events(tmp_path: Path) -> None:
    _, plan = plan_of(tmp_path)
    argv = plan.vllm.argv
    assert argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "9101"
    assert flag(argv, "--model") == str(tmp_path / "model") and flag(argv, "--served-model-name") == "smollm2"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    assert int(flag(argv, "--shutdown-timeout")) < GRACE_S  # the connector flushes before it is killed
    transfer = json.loads(flag(argv, "--kv-transfer-config"))
    assert transfer["kv_connector"] == "PrefixCacheConnector"
    assert transfer["kv_connector_module_path"] == "prefixcache.integrations.vllm"
    assert transfer["kv_role"] == "kv_both"
    connector = parse_settings(transfer["kv_connector_extra_config"])  # what the connector will read
    assert connector.cache.isolation == "partitioned"
    assert [t.kind for t in connector.cache.tiers] == ["memory", "disk"]
    assert connector.cache.tiers[1].path == str(tmp_path / "disk")
    events = json.loads(flag(argv, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq" and events["topic"] == "kv"
    for endpoint in (events["endpoint"], events["replay_endpoint"]):  # vLLM binds ipc://, never the network
        assert endpoint.startswith(f"ipc://{tmp_path / 'events'}/")
    assert plan.vllm.health == "http://127.0.0.1:9101/health"


def test_cpu_flags_only_without_a_gpu_and_the_block_size_both_children_use(tmp_path: Path) -> None:
    _, cpu = plan_of(tmp_path, environ={"VLLM_CPU_KVCACHE_SPACE": "2"})
    _, gpu = plan_of(tmp_path, gpu=True)
    assert flag(cpu.vllm.argv, "--dtype") == "float32" and "--enforce-eager" in cpu.vllm.argv
    assert "--dtype" not in gpu.vllm.argv and "--enforce-eager" not in gpu.vllm.argv
    assert cpu.vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_CPU_KVCACHE_SPACE" not in gpu.vllm.env
    for plan, block in ((cpu, "128"), (gpu, "16")):
        assert flag(plan.vllm.argv, "--block-size") == flag(plan.route.argv, "--block-size") == block
    settings = load_settings(settings_file(tmp_path), env={})
    extra = options(tmp_path, block_size=32, vllm_args=("--max-model-len", "4096"))
    argv = build_plan(settings, extra, SECRET, {}).vllm.argv
    assert argv[-2:] == ("--max-model-len", "4096")  # last: vLLM takes the last of a repeated flag
    assert flag(argv, "--block-size") == "32"


def test_the_router_fronts_that_vllm_with_the_settings(tmp_path: Path) -> None:
    _, plan = plan_of(tmp_path)
    argv = plan.route.argv
    assert argv[1:4] == ("-m", "prefixcache.cli", "route")
    assert flag(argv, "--config") == str(tmp_path / "prefixcache.toml")
    assert (flag(argv, "--host"), flag(argv, "--port"), flag(argv, "--model-id")) == ("127.0.0.1", "8100", "smollm2")
    source = VllmSource.parse(flag(argv, "--vllm-backend"), 128, "smollm2")  # as `route` parses it
    events = json.loads(flag(plan.vllm.argv, "--kv-events-config"))
    assert source.url == "http://127.0.0.1:9101"
    assert (source.endpoint, source.replay, source.topic) == (events["endpoint"], events["replay_endpoint"], "kv")
    assert (plan.route.health, plan.route.status) == ("http://127.0.0.1:8100/healthz", "ok")
    assert plan.url == "http://127.0.0.1:8100/v1"


def test_each_child_gets_the_secret_by_the_name_it_reads_and_no_command_line_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(settings_file(tmp_path, secret=""), env={})
    secret, source = tenant_secret(settings, {})
    plan = build_plan(settings, options(tmp_path), secret, {})
    assert all(secret not in arg for arg in (*plan.vllm.argv, *plan.route.argv))
    assert secret not in repr(plan)
    inherited = {SECRET_ENV: "stale-secret-0123456789", ROUTER_SECRET_ENV: "stale-too-0123456789", "HOME": "/h"}
    vllm, route = plan.vllm.environ(inherited), plan.route.environ(inherited)
    assert vllm[SECRET_ENV] == secret and ROUTER_SECRET_ENV not in vllm and vllm["HOME"] == "/h"
    assert route[ROUTER_SECRET_ENV] == secret and SECRET_ENV not in route
    # vLLM asks every API request for a key, the router's own, which no client is given
    key = vllm[VLLM_KEY_ENV]
    assert len(key) >= 32 and key != secret and route[ROUTER_KEY_ENV] == key and VLLM_KEY_ENV not in route
    assert ROUTER_KEY_ENV not in vllm and all(key not in arg for arg in (*plan.vllm.argv, *plan.route.argv))
    assert load_settings(settings_file(tmp_path, secret=""), env=route).auth.backend_key == key
    # what each one reads there: the router its settings, the connector its variable
    assert route_secret(load_settings(settings_file(tmp_path, secret=""), env=route), route) == secret.encode()
    monkeypatch.setenv(SECRET_ENV, vllm[SECRET_ENV])
    assert read_secret(ConnectorSettings()) == secret.encode()
    assert source == "generated for this run"


def test_the_secret_is_the_settings_else_the_environments_else_a_new_one(tmp_path: Path) -> None:
    configured = load_settings(settings_file(tmp_path), env={})
    bare = load_settings(settings_file(tmp_path, secret=""), env={})
    other = "from-the-environment-0123456789"
    assert tenant_secret(configured, {SECRET_ENV: other}) == (SECRET, "from the settings")
    assert tenant_secret(bare, {SECRET_ENV: other}) == (other, f"from ${SECRET_ENV}")
    first, second = tenant_secret(bare, {})[0], tenant_secret(bare, {})[0]
    assert first != second and len(first) >= 32
    with pytest.raises(ValueError, match="at least 16 bytes") as error:
        tenant_secret(bare, {SECRET_ENV: "short-one"})
    assert "short-one" not in str(error.value)


def test_dry_run_prints_both_command_lines_and_never_the_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFIXCACHE_CONFIG", raising=False)
    config = settings_file(tmp_path)
    args = ["serve-vllm", "--config", str(config), "--model", str(tmp_path), "--vllm-port", "9101", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    lines = out.splitlines()
    assert lines[0] == "# vllm" and lines[2] == "# route"
    vllm, route = shlex.split(lines[1]), shlex.split(lines[3])
    assert {f"{SECRET_ENV}=***", f"{VLLM_KEY_ENV}=***"} <= set(vllm)
    assert {f"{ROUTER_KEY_ENV}=***", f"{ROUTER_SECRET_ENV}=***"} <= set(route)
    assert "127.0.0.1" in vllm and flag(tuple(route), "--config") == str(config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read the config file"),
        ("[auth\n", "is not valid TOML"),
        ("[cache]\npolicy_x = 1\n", "unknown setting cache.policy_x"),
        ('[auth]\ntenant_secret = "tiny-secret"\n', "invalid setting auth.tenant_secret"),
    ],
)
def test_a_bad_config_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main(["serve-vllm", "--config", str(path), "--model", str(tmp_path), "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "tiny-secret" not in err


def test_an_open_address_without_api_keys_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "local.toml"
    path.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["serve-vllm", "--config", str(path), "--model", str(tmp_path), "--host", "0.0.0.0", "--dry-run"])
    assert exit_.value.code == 2 and "no [auth] api_keys" in capsys.readouterr().err


# ---------------------------------------------------------------------- the supervisor

# A stand-in child: serves {"status": "ok"} on every GET; records its pid and the two
# variables; exits with status 3 after DIE seconds (when >= 0); ignores SIGTERM on asking.
STANDIN = """
import http.server, json, os, signal, sys, threading, time
port, record, die, deaf = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "deaf"
if deaf:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("starting", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status": "ok"}'
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", port), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
env = {k: os.environ.get(k) for k in ("STANDIN_SECRET", "STALE")}
with open(record, "w") as f:
    json.dump({"pid": os.getpid(), **env}, f)
if die >= 0:
    time.sleep(die); sys.exit(3)
while True:
    time.sleep(0.2)
"""
DRIVER = """
import json, sys
from pathlib import Path
from prefixcache.fleet.supervisor import Child, supervise
spec = json.loads(sys.argv[1])
children = [Child(**c) for c in spec["children"]]
sys.exit(supervise(children, lambda: print("READY", flush=True), Path(spec["logs"]), grace_s=1.0))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def standin(tmp_path: Path, name: str, die: float = -1, deaf: bool = False) -> dict[str, object]:
    port = free_port()
    return {
        "name": name,
        "argv": [
            sys.executable,
            "-c",
            STANDIN,
            str(port),
            str(tmp_path / f"{name}.json"),
            str(die),
            "deaf" if deaf else "-",
        ],
        "health": f"http://127.0.0.1:{port}/healthz",
        "status": "ok",
        "env": {"STANDIN_SECRET": f"secret-of-{name}"},
        "unset": ["STALE"],
        "ready_s": 20,
    }


def start(tmp_path: Path, *children: dict[str, object]) -> subprocess.Popen[str]:
    spec = json.dumps({"children": list(children), "logs": str(tmp_path / "logs")})
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "STALE": "inherited"},
    )


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    assert ready and proc.stdout.readline() == "READY\n"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def record(tmp_path: Path, name: str) -> dict[str, object]:
    return dict(json.loads((tmp_path / f"{name}.json").read_text()))


def test_sigterm_stops_both_children_even_one_that_ignores_it(tmp_path: Path) -> None:
    proc = start(tmp_path, standin(tmp_path, "vllm"), standin(tmp_path, "route", deaf=True))
    wait_ready(proc)
    children = [record(tmp_path, name) for name in ("vllm", "route")]
    assert [c["STANDIN_SECRET"] for c in children] == ["secret-of-vllm", "secret-of-route"]
    assert all(c["STALE"] is None for c in children)  # unset from what the supervisor inherited
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0  # the deaf one killed ...
    assert time.monotonic() - started >= 1.0  # ... after the grace period (1 s here)
    assert not any(alive(int(str(c["pid"]))) for c in children)


def test_when_one_child_exits_the_other_is_stopped_and_the_status_is_1(tmp_path: Path) -> None:
    proc = start(tmp_path, standin(tmp_path, "vllm"), standin(tmp_path, "route", die=1.5))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert "route exited" in err and "status 3" in err and "starting" in err  # with the end of its log
    assert not alive(int(str(record(tmp_path, "vllm")["pid"])))


def test_a_child_that_fails_to_start_stops_the_ones_before_it(tmp_path: Path) -> None:
    broken = standin(tmp_path, "route") | {
        "argv": [sys.executable, "-c", "print('no model here'); raise SystemExit(5)"]
    }
    proc = start(tmp_path, standin(tmp_path, "vllm"), broken)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and "READY" not in out
    assert "route exited with status 5 while starting" in err and "no model here" in err
    assert not alive(int(str(record(tmp_path, "vllm")["pid"])))
