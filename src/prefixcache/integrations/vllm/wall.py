"""The wall between vLLM's engine and the connector (design invariant 17).

vLLM calls the connector's hooks inside its engine core (the scheduler's half) and its
workers (the worker's half). There an exception is fatal: the engine dies for every
tenant (``EngineDeadError``), whatever request brought it. So the body of every hook
runs inside ``Wall.hold``::

    with self.wall.hold("get_num_new_matched_tokens"):
        return self._matched(request, num_computed_tokens)
    self._bypass(request, "get_num_new_matched_tokens")  # reached only when the body raised
    return 0

An ``Exception`` raised in the body is swallowed, counted under (hook, exception type)
and logged with its traceback the first time that pair is seen (then at debug level,
since a client can repeat it at will). The code after the block is the hook's failure
answer: what it returns then, and how it leaves the books, is each hook's contract
(``scheduler.py``, ``worker_hooks.py``, docs/vllm.md). ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``) still passes: vLLM's shutdown.

The counts travel to vLLM's ``/metrics`` as ``prefixcache_vllm_hook_failures_total``
(``Tally.hook_failures``, ``metrics.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from types import TracebackType

__all__ = ["Hold", "Wall"]

log = logging.getLogger("prefixcache.vllm")


class Hold:
    """One hook's call behind the wall; ``failed`` tells the code after the block why it runs."""

    __slots__ = ("_hook", "_wall", "failed")

    def __init__(self, wall: Wall, hook: str) -> None:
        self._wall, self._hook = wall, hook
        self.failed = False

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception):
            return False
        self.failed = True
        self._wall.breach(self._hook, exc)
        return True


class Wall:
    """Counts what each hook raised, since the last ``take``; logs each kind once."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger
        self._lock = threading.Lock()  # NOTE: the worker's loads run on I/O threads
        self._seen: set[tuple[str, str]] = set()
        self._failures: Counter[tuple[str, str]] = Counter()
        self.total = 0  # every failure since start, for tests and diagnostics

    def hold(self, hook: str) -> Hold:
        return Hold(self, hook)

    def breach(self, hook: str, exc: BaseException) -> None:
        key = (hook, type(exc).__name__)
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
            self._failures[key] += 1
            self.total += 1
        if first:
            self._log.error(
                "prefixcache: %s raised %s; the connector answered as for a miss (counted in "
                "prefixcache_vllm_hook_failures_total; logged once per hook and kind)",
                hook,
                key[1],
                exc_info=exc,
            )
        else:
            self._log.debug("prefixcache: %s raised %s again", hook, key[1])

    def take(self) -> Counter[tuple[str, str]]:
        """The failures since the last call, by (hook, exception type)."""
        with self._lock:
            taken, self._failures = self._failures, Counter()
        return taken
