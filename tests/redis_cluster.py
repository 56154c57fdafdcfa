"""Test helper: a real Redis Cluster of masters (no replicas) on loopback ports.

Each node is a ``RedisServer`` (tests/redis_server.py) started with cluster mode on and
its own ``nodes-<port>.conf`` in the work directory, so a node killed and started again
rejoins with its identity and slots (and no data: there is no persistence). The slots
are assigned by ``redis-cli --cluster create``. Every wait is bounded.

NOTE: ``cluster-require-full-coverage no`` keeps the other masters serving once the
cluster has marked a dead master failed (by default the whole cluster refuses queries
then); the docs tell operators to set it too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from redis_server import RedisServer, free_port

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 500  # how soon the cluster marks a silent master failed
FORM_TIMEOUT = 10.0  # seconds the cluster gets to agree on its slots


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (10,000 above it) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10_000 < 65_536 and _free(port + 10_000):
            return port
    raise RuntimeError("no free pair of ports for a cluster node")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def command(port: int, *args: str, timeout: float = 1.0) -> str:
    """One command over raw RESP (inline form), its reply as text (bulk, simple or error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall((" ".join(args) + "\r\n").encode())
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, _, rest = data.partition(b"\r\n")
            if head[:1] in (b"+", b"-", b":"):
                return head[1:].decode()
            if head[:1] == b"$" and len(rest) >= int(head[1:]) + 2:
                return rest[: int(head[1:])].decode()
    raise RuntimeError(f"no reply from port {port} to {args}")


class LocalCluster:
    """``masters`` cluster-mode ``redis-server`` processes on loopback, slots spread evenly."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        for _ in range(masters):
            port = cluster_port()
            extra = (
                *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
                *("--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no"),
            )
            self.nodes.append(RedisServer(workdir, port=port, extra=extra))

    @property
    def url(self) -> str:
        """A startup node's URL (the first node's)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{port}" for port in self.ports]
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=FORM_TIMEOUT,
            )
            self.wait_ok(self.ports)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, ports: list[int]) -> None:
        """Until every node of ``ports`` says the cluster is ok and knows all the others."""
        deadline = time.monotonic() + FORM_TIMEOUT
        while time.monotonic() < deadline:
            if all(self._agrees(port) for port in ports):
                return
            time.sleep(0.02)
        raise RuntimeError(f"the cluster did not form within {FORM_TIMEOUT} s")

    def _agrees(self, port: int) -> bool:
        try:
            info = command(port, "CLUSTER", "INFO")
            nodes = command(port, "CLUSTER", "NODES")
        except OSError:
            return False
        connected = [line for line in nodes.splitlines() if " connected" in line and "fail" not in line.split()[2]]
        return "cluster_state:ok" in info and len(connected) == len(self.nodes)

    def wait_failed(self, dead: RedisServer) -> None:
        """Until every other node has marked ``dead`` failed (the state after node-timeout)."""
        deadline = time.monotonic() + FORM_TIMEOUT
        others = [node.port for node in self.nodes if node is not dead]
        while time.monotonic() < deadline:
            if all(self._marks_failed(port, dead.port) for port in others):
                return
            time.sleep(0.02)
        raise RuntimeError(f"the cluster did not mark port {dead.port} failed within {FORM_TIMEOUT} s")

    @staticmethod
    def _marks_failed(port: int, dead_port: int) -> bool:
        for line in command(port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if fields[1].startswith(f"127.0.0.1:{dead_port}@"):
                return "fail" in fields[2].split(",")
        return False

    def owner(self, slot: int) -> RedisServer:
        """The node that serves ``slot`` (from the first live node's view)."""
        live = next(node for node in self.nodes if node.proc is not None and node.proc.poll() is None)
        for line in command(live.port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            for span in fields[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                    return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def revive(self) -> None:
        """Every node running and answering (a killed one started again, a paused one resumed),
        and the cluster ok on all of them."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.resume()
            else:
                node.start()
        self.wait_ok(self.ports)

    def flushall(self) -> None:
        for node in self.nodes:
            command(node.port, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
