"""``serial_torch``: a thread that calls it runs torch on one core, the others keep theirs,
and the engine's cache I/O thread calls it, so the worker's OpenMP team is the only one.

Each check runs in a fresh interpreter: OpenMP's per-thread state is the process's, and
pytest's own thread must not be changed for the tests that follow."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, os, threading, torch
    from prefixcache.engine import threads
    gomp = threads._gomp()
    assert gomp is not None, "torch is expected on GNU OpenMP here"
    seen = {}
    def mine():
        assert threads.serial_torch()
        torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel operation after it
        torch.ones(4_000_000).add_(1)
        seen["serial"] = gomp.omp_get_max_threads()
    def other():
        torch.ones(512, 512) @ torch.ones(512, 512)
        seen["other"] = gomp.omp_get_max_threads()
    for target in (mine, other):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    from prefixcache.engine.cacheio import CacheIO
    io = CacheIO(lambda: None, share=False)
    done = threading.Event()
    def task():
        seen["io"] = gomp.omp_get_max_threads()
        done.set()
    io._put(task)
    assert done.wait(10)
    io.close(10)
    print(seen["serial"], seen["other"], seen["io"], torch.get_num_threads())
    """
)


def test_a_serial_thread_runs_on_one_core_and_the_others_keep_theirs() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    serial, other, io, configured = (int(x) for x in out.stdout.split())
    if configured < 2:
        pytest.skip("one core: nothing to keep apart")
    assert (serial, io) == (1, 1)  # the thread that asked, and the cache's I/O thread
    assert other == configured  # a thread that did not ask (the engine's worker) keeps torch's threads
