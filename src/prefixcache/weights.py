"""The weights' identity by content: the model part of every cache key and gate verdict.

    folder: config.json + weight files (*.safetensors, *.bin, *.pt, *.pth, *.gguf)
      each file  ──> xxh3-128 of its bytes              (DigestMemo: once per file stamp)
      content    ──> xxh3-128 over (name, digest) of each file, in name order
    fingerprint  =   xxh3-128(dtype, content), 16 hex digits

    our server      served_id@fingerprint     (``LoadedModel.key``: the engine's contexts)
    vLLM connector  name@fingerprint          (``model_key``)
    quality gates   folder-name@fingerprint   (``quality.reference.model_fingerprint``)

Any byte of config.json or of a weight file changes the fingerprint, whatever the names
and sizes, and so does the KV dtype; the same bytes in two folders (``/models/v1/llama``,
``/models/v2/llama``) have one fingerprint, since their KV is the same. Adapters are
fingerprinted the same way (``files_fingerprint`` with ``adapter_config.json``).

Reading every byte at each start is what a large model cannot afford twice (its load
reads them too), so each file's digest is kept by the file's stamp (device, inode,
size, mtime and ctime in nanoseconds) in a small JSON file, ``weights-memo.json`` in the
models dir (``DigestMemo``): a restart on unchanged weights costs a few ``stat`` calls.
A write moves ctime, which no user tool sets back (``touch -r``, ``rsync -t`` and
``cp -p`` restore mtime only), so a rewritten file is read again even at its old size
and mtime. The memo is trusted as the models dir is: whoever may write it may name any
digest for any stamp, so it must be writable by the server's user alone.

NOTE: timestamps move in coarse ticks, so a file written again within the tick of the
stamp taken would keep that stamp. A file whose ctime is within ``RACY_NS`` of the
moment its digest is taken is therefore never memoized (git's "racy" rule): it is read
again at the next start, and its stamp is memoized only once it has stood still.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

__all__ = [
    "MEMO_FILE",
    "MODEL_FILES",
    "RACY_NS",
    "WEIGHT_GLOBS",
    "DigestMemo",
    "WeightsChanged",
    "file_digest",
    "files_fingerprint",
    "folder_content",
    "folder_stamps",
    "keyed",
    "model_key",
    "weights_fingerprint",
]

log = logging.getLogger("prefixcache.weights")

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
MODEL_FILES = ("config.json",)  # beside the weights: what the architecture is
MEMO_FILE = "weights-memo.json"
RACY_NS = 2_000_000_000
MEMO_LIMIT = 4096  # entries kept in the memo file
_CHUNK = 16 << 20
_TAG = b"prefixcache-files\0v2\0"

Stamp = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


class WeightsChanged(OSError):
    """A file changed while its digest was taken: no fingerprint names bytes in flux."""


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_digest(path: Path) -> bytes:
    """xxh3-128 of the file's bytes, read in chunks."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()


@dataclass(frozen=True, slots=True)
class _Entry:
    stamp: Stamp
    digest: bytes


class DigestMemo:
    """File digests by stamp (module doc), in memory and, given ``path``, in a JSON file
    read once and written by ``save``. ``clock`` (ns, the file timestamps' clock) and
    ``digest`` are injectable for tests; ``computed`` counts the digests actually taken.

        {"version": 1, "files": {"/abs/path": [dev, ino, size, mtime_ns, ctime_ns, "hex"]}}

    An unreadable file is read as empty (a warning), one that cannot be written leaves
    the memo in memory (a warning): either costs a read of the weights, never a wrong
    digest."""

    VERSION = 1

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
        racy_ns: int = RACY_NS,
        digest: Callable[[Path], bytes] = file_digest,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.computed = 0
        self._clock, self._racy_ns, self._digest = clock, racy_ns, digest
        self._entries: dict[str, _Entry] | None = None
        self._dirty = False
        self._lock = threading.Lock()

    def digest(self, path: Path) -> bytes:
        """The digest of ``path``'s bytes now; raises ``WeightsChanged`` when the file
        changed while it was read, ``OSError`` when it cannot be read."""
        name = os.path.abspath(path)
        before = stamp_of(os.stat(path))
        with self._lock:
            known = self._load().get(name)
        if known is not None and known.stamp == before:
            return known.digest
        started = self._clock()
        value = self._digest(path)
        if stamp_of(os.stat(path)) != before:
            raise WeightsChanged(f"{path} changed while it was read; start again once it is written")
        with self._lock:
            self.computed += 1
            if max(before[3], before[4]) < started - self._racy_ns:  # NOTE: the racy rule (module doc)
                self._load()[name] = _Entry(before, value)
                self._dirty = True
        return value

    def save(self) -> None:
        """Write the memo file when something was added (atomically: a temporary file
        renamed), leaving out the files that are gone."""
        with self._lock:
            if self.path is None or not self._dirty or self._entries is None:
                return
            entries = {k: e for k, e in self._entries.items() if os.path.exists(k)}
            kept = list(entries.items())[-MEMO_LIMIT:]
            doc = {"version": self.VERSION, "files": {k: [*e.stamp, e.digest.hex()] for k, e in kept}}
            self._dirty = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            log.warning(
                "event=weights_memo_unwritable path=%s error=%r: the weights are read again at the next start",
                self.path,
                str(exc),
            )

    def _load(self) -> dict[str, _Entry]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def _read(self) -> dict[str, _Entry]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("version") != self.VERSION:
                raise ValueError(f"version {doc.get('version')!r}, this reads {self.VERSION}")
            return {
                str(k): _Entry((int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4])), bytes.fromhex(v[5]))
                for k, v in doc["files"].items()
            }
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            log.warning("event=weights_memo_unreadable path=%s error=%r: read as empty", self.path, str(exc))
            return {}


def _names(folder: Path, globs: tuple[str, ...], extra: tuple[str, ...]) -> list[str]:
    found = {p.name for g in globs for p in folder.glob(g) if p.is_file()}
    return sorted(found | {e for e in extra if (folder / e).is_file()})


def files_fingerprint(
    folder: Path, globs: tuple[str, ...] = WEIGHT_GLOBS, extra: tuple[str, ...] = (), memo: DigestMemo | None = None
) -> str:
    """A hash of ``folder``'s weight files and ``extra`` files, by name and bytes in name
    order (each name length-prefixed, each file's bytes as their fixed-size digest, so no
    two folders frame alike): any change of a byte changes it, whatever the sizes."""
    memo = memo if memo is not None else DigestMemo()
    digest = xxhash.xxh3_128(_TAG)
    for name in _names(folder, globs, extra):
        raw = os.fsencode(name)
        digest.update(b"%d:%b" % (len(raw), raw) + memo.digest(folder / name))
    return digest.hexdigest()


def folder_content(folder: Path, memo: DigestMemo | None = None) -> str:
    """A model folder's content hash: its config.json and weight files (the dtype apart)."""
    return files_fingerprint(folder, extra=MODEL_FILES, memo=memo)


def folder_stamps(folder: Path) -> tuple[tuple[str, Stamp], ...]:
    """The stamps of the files ``folder_content`` reads: equal before and after a load
    when no file was written meanwhile (a cheap check, no byte read)."""
    return tuple((n, stamp_of(os.stat(folder / n))) for n in _names(folder, WEIGHT_GLOBS, MODEL_FILES))


def weights_fingerprint(content: str, dtype: str) -> str:
    """The model's fingerprint: its content hash and the dtype its KV is computed in."""
    return xxhash.xxh3_128(json.dumps(["prefixcache-weights", 1, dtype, content]).encode()).hexdigest()[:16]


def keyed(name: str, fingerprint: str) -> str:
    """A model's id in cache keys: the name it is served under, and its fingerprint.
    NOTE: the fingerprint is of fixed length, so the pair reads back whatever ``name`` holds."""
    return f"{name}@{fingerprint}"


def model_key(
    name: str, model_dir: str | None, dtype: str, revision: str | None = None, memo: DigestMemo | None = None
) -> str:
    """The model's identity in cache keys: ``name@fingerprint`` of its local folder, so
    that changed weights under the same name (even of the same size) start a new key
    space: the old blocks are never matched again and leave by eviction. A model that
    is not a local folder is keyed by its name and revision (a hub commit names its
    contents), with a warning when no revision pins it."""
    folder = Path(model_dir) if model_dir else None
    if folder is not None and folder.is_dir():
        return keyed(name, weights_fingerprint(folder_content(folder, memo), dtype))
    if not revision:
        log.warning(
            "prefixcache: model %s is not a local folder and no revision pins it: its weights' "
            "contents are not in the cache keys",
            model_dir,
        )
    return keyed(
        name, xxhash.xxh3_128(json.dumps(["prefixcache-hub", 1, dtype, model_dir, revision]).encode()).hexdigest()[:16]
    )
