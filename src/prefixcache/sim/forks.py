"""Independent parts of one computation in forked processes, one per CPU.

The sampled curves (miniatures.py) replay one request stream on many kernel trees
that share nothing: split the trees into parts and each part runs in its own process
over the same stream. A forked child inherits the caller's state (the trace source, a
closure, the sketch of sampling units) as it is, so nothing but each part's small
result crosses a pipe. Where ``fork`` is not available, the parts run one after the
other in this process: the same results, later.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # NOTE: not on every platform
        return os.cpu_count() or 1


def processes(jobs: int | None) -> int:
    """How many processes to run: ``jobs`` (at least 1), or one per CPU for None."""
    if jobs is None:
        return cpus()
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    return jobs


def fork_map(fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """``[fn(part) for part in parts]``, the first part in this process and each other in
    a forked child at the same time. A child's exception is raised here (as a
    ``RuntimeError`` with its traceback when it cannot be pickled); a child that dies
    without an answer is a ``RuntimeError`` naming its exit code."""
    if len(parts) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(part) for part in parts]
    context = multiprocessing.get_context("fork")
    children = []
    try:
        for part in parts[1:]:
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_child, args=(fn, part, send), daemon=True)
            child.start()
            send.close()
            children.append((child, receive))
        results = [fn(parts[0])]
        for child, receive in children:
            try:
                ok, payload = receive.recv()
            except EOFError:
                child.join()
                raise RuntimeError(f"a worker process died without an answer (exit code {child.exitcode})") from None
            child.join()
            if not ok:
                raise payload
            results.append(payload)
        return results
    finally:
        for child, receive in children:
            receive.close()
            if child.is_alive():
                child.kill()
                child.join()


def _child(fn: Callable[[T], R], part: T, send: Connection) -> None:
    try:
        answer: tuple[bool, object] = (True, fn(part))
    except BaseException as exc:  # NOTE: every failure goes back to the parent, which raises it
        answer = (False, exc)
        try:
            pickle.dumps(exc)
        except Exception:
            answer = (False, RuntimeError(f"in a worker process:\n{traceback.format_exc()}"))
    send.send(answer)
    send.close()
