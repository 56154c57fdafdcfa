"""Parts of one computation in forked processes (sim/forks.py): answers in order,
a child's failure raised in the caller, never a silent gap."""

from __future__ import annotations

import os
import threading

import pytest

from prefixcache.sim.forks import cpus, fork_map, processes


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def test_each_part_runs_in_its_own_process_and_answers_in_order() -> None:
    got = fork_map(_pid_and_square, [1, 2, 3, 4])
    assert [square for _, square in got] == [1, 4, 9, 16]
    assert got[0][0] == os.getpid() and len({pid for pid, _ in got}) == 4


def test_a_child_sees_the_callers_state() -> None:
    state = {"seen": [10, 20, 30]}  # a closure over local state: nothing is pickled on the way in
    assert fork_map(lambda i: state["seen"][i], [0, 1, 2]) == [10, 20, 30]


def test_a_childs_exception_is_raised_in_the_caller() -> None:
    def part(i: int) -> int:
        if i == 2:
            raise ValueError("part two is bad")
        return i

    with pytest.raises(ValueError, match="part two is bad"):
        fork_map(part, [0, 1, 2])


def test_an_exception_that_cannot_be_pickled_comes_back_with_its_traceback() -> None:
    class Unpicklable(Exception):
        def __init__(self) -> None:
            super().__init__("no way back")
            self.lock = threading.Lock()

    def part(i: int) -> int:
        if i:
            raise Unpicklable()
        return i

    with pytest.raises(RuntimeError, match=r"(?s)in a worker process.*no way back"):
        fork_map(part, [0, 1])


def test_a_child_that_dies_is_an_error_not_a_gap() -> None:
    def part(i: int) -> int:
        if i:
            os._exit(3)
        return i

    with pytest.raises(RuntimeError, match="exit code 3"):
        fork_map(part, [0, 1])


def test_one_part_runs_here() -> None:
    assert fork_map(_pid_and_square, [5]) == [(os.getpid(), 25)]
    assert fork_map(_pid_and_square, []) == []
    assert cpus() >= 1


def test_processes_is_one_per_cpu_or_the_number_asked() -> None:
    assert processes(None) == cpus() >= 1
    assert processes(3) == 3
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"jobs must be >= 1, got {bad}"):
            processes(bad)
