"""How vLLM's scheduler asks the worker what prefixcache holds.

vLLM runs its scheduler and its workers in different processes (on CPU always), and
the cache (its ledger and its bytes) lives in the worker, beside the KV it fills. The
scheduler's ``get_num_new_matched_tokens`` asks it over a Unix socket: one request,
one answer, a fixed binary format (no pickle)::

    request:  magic "PCL3", u32 scope bytes, u32 tokens, scope (msgpack), tokens (u32 LE)
    answer:   u32 cached tokens, u8 why fewer than the chain held (0: not fewer; else
              1 + the index of the ``MissReason``)

The scope (``scope.py``) is the request's tenant, adapter and media items: what keys
its KV besides the tokens. A lookup is side-effect free (``PrefixCache.peek``: no
pin, no policy touch, no counter; vLLM's scheduler may ask again for a request that
stays waiting): the worker matches when it loads, and reports the blocks it could not
load, which vLLM then recomputes. A worker
that does not answer within the timeout counts as a miss: the scheduler never waits
on a slow cache longer than that.

The socket answers any scope it is asked about, so only this user may reach it: it
lives in a private folder, ``<socket_dir>/prefixcache-<uid>/`` (mode 0700, created so,
or refused at start when it exists but is not this user's own, private directory), and
is itself mode 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from prefixcache.integrations.vllm.groups import Found, MissReason
from prefixcache.integrations.vllm.scope import Scope, decode_scope, encode_scope

__all__ = ["LookupClient", "LookupServer", "private_dir", "socket_path"]

log = logging.getLogger("prefixcache.vllm")

MAGIC = b"PCL3"
_HEAD = struct.Struct("<4sII")
_ANSWER = struct.Struct("<IB")
_REASONS = tuple(MissReason)
MAX_TOKENS = 1 << 24
MAX_SCOPE = 1 << 20  # bytes of a scope: a tenant, an adapter and the media items

Lookup = Callable[[np.ndarray, Scope], Found]  # (tokens, scope) -> cached tokens, and why not more


def socket_path(engine_id: str, directory: str | None = None) -> str:
    """Where the worker of engine ``engine_id`` listens: in this user's private folder
    under ``directory`` (default ``$XDG_RUNTIME_DIR``, else ``/tmp``); short, since Unix
    socket paths are limited."""
    base = Path(directory or os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:40] or "engine"
    return str(base / f"prefixcache-{os.getuid()}" / f"{safe}.sock")


def private_dir(folder: Path, uid: int | None = None) -> Path:
    """``folder``, created mode 0700 when missing; an existing one must be a directory
    (not a link) owned by ``uid`` (default: this user) that neither group nor others may
    enter. Anything else is a ``PermissionError`` that says what to do: in a shared
    ``/tmp`` another user can create the folder first, and must never hold our socket."""
    owner = os.getuid() if uid is None else uid
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)  # the umask can only take bits away
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"prefixcache: lookup socket folder {folder} is not a directory (a link?): remove it")
    if st.st_uid != owner:
        raise PermissionError(
            f"prefixcache: lookup socket folder {folder} belongs to uid {st.st_uid}, not to this user ({owner}): "
            "remove it, or set kv_connector_extra_config socket_dir to a folder of your own"
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"prefixcache: lookup socket folder {folder} is open to group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): `chmod 700 {folder}`, or remove it"
        )
    return folder


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


class LookupServer:
    """The worker's side: a thread that answers lookups with ``lookup(tokens, scope)``."""

    def __init__(self, path: str, lookup: Lookup) -> None:
        self.path = path
        self._lookup = lookup
        private_dir(Path(path).parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by a worker that died, in our own folder
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # NOTE: bound with the umask's mode; the folder kept others out meanwhile
        self._sock.listen(8)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="prefixcache-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="prefixcache-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self._answer(conn)
        self._conns.discard(conn)

    def _answer(self, conn: socket.socket) -> None:
        while True:
            try:
                magic, n_scope, n_tokens = _HEAD.unpack(_recv_exact(conn, _HEAD.size))
                if magic != MAGIC or n_scope > MAX_SCOPE or n_tokens > MAX_TOKENS:
                    log.warning("prefixcache lookup: malformed request, closing the connection")
                    return
                scope = decode_scope(_recv_exact(conn, n_scope))
                tokens = np.frombuffer(_recv_exact(conn, 4 * n_tokens), dtype="<u4")
            except ValueError:
                log.warning("prefixcache lookup: malformed scope, closing the connection")
                return
            except (ConnectionError, OSError):
                return
            try:
                found = self._lookup(tokens, scope)
                answer = _ANSWER.pack(found.tokens, 0 if found.reason is None else 1 + _REASONS.index(found.reason))
            except Exception:  # a lookup that fails is a miss, never a dead scheduler
                log.exception("prefixcache lookup failed")
                answer = _ANSWER.pack(0, 0)
            try:
                conn.sendall(answer)
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class LookupClient:
    """The scheduler's side: ``lookup`` returns the cached tokens (and why not more), 0
    when the worker cannot be asked (not up yet, gone, slower than ``timeout`` seconds)."""

    def __init__(self, path: str, timeout: float = 1.0) -> None:
        self.path = path
        self.timeout = timeout
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self.failures = 0

    def lookup(self, tokens: Sequence[int] | np.ndarray, scope: Scope) -> Found:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
            raise ValueError("token ids must fit in 32 bits")
        body = encode_scope(scope)
        if len(body) > MAX_SCOPE or ids.size > MAX_TOKENS:
            raise ValueError("lookup too large")
        message = _HEAD.pack(MAGIC, len(body), ids.size) + body + ids.astype("<u4").tobytes()
        with self._lock:
            try:
                conn = self._connect()
                conn.sendall(message)
                cached, why = _ANSWER.unpack(_recv_exact(conn, _ANSWER.size))
                return Found(int(cached), _REASONS[why - 1] if 0 < why <= len(_REASONS) else None)
            except OSError as exc:  # socket.timeout and ConnectionError are OSErrors
                self.failures += 1
                log.warning("prefixcache lookup unavailable (%s): counted as a miss", exc)
                self._drop()
                return Found(0)

    def _connect(self) -> socket.socket:
        if self._conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self.timeout)
            try:
                conn.connect(self.path)
            except OSError:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
