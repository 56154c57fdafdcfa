"""One OpenMP team in the process: the engine's worker thread's.

torch runs its parallel operations on OpenMP. GNU OpenMP (libgomp, which the Linux wheels
carry) keeps a team of threads for every thread that ran a parallel operation, for as
long as that thread lives; while a second team lives beside the worker's, the process
has more OpenMP threads than cores, and libgomp stops letting idle team threads wait
for the next operation: each of the worker's parallel operations (hundreds a decode
step) then wakes its team from sleep, and a step costs markedly more
(``benchmarks/bench_serve_load.py`` runs the server's setup, ``docs/server.md`` has its
figures). So every thread of the server that runs torch but is not the worker (the one
that loads the model, the cache's I/O workers) runs its torch operations on one core:
they are copies and a model load, which one core serves as well.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

__all__ = ["serial_torch"]


@functools.cache
def _gomp() -> Any | None:
    """torch's libgomp, when it runs on one (None: another OpenMP, or none)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        return ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
    except OSError:
        return None


def serial_torch() -> bool:
    """Run the calling thread's torch operations on one core from now on (before its first
    parallel one, so that it never holds an OpenMP team); False when torch does not run
    on GNU OpenMP, and nothing changed. Other threads keep ``torch.get_num_threads()``."""
    gomp = _gomp()
    if gomp is None:
        return False
    torch.get_num_threads()  # NOTE: torch sets this thread's OpenMP threads at its first use; ours must come after
    gomp.omp_set_num_threads(1)
    return True
