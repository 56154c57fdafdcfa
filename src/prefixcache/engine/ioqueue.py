"""Which cache task an I/O worker runs next: the decisions of ``cacheio.py``, with no
threads and no I/O, so that every order they allow can be tested (``IOQueue``).

    put(task) ──> pending, in arrival order; a task may run once
                    - every task it comes after is done: its owner's (its job's) earlier
                      tasks, and, for a stage, the stores not done yet of the same scope
                      (cache context) whose prompt its own prompt extends (the
                      conversation's earlier turns)
                    - its tenant runs fewer than ``per_tenant`` tasks
                    - fewer than ``workers`` tasks run
    take()    ──> the first pending task in arrival order that may run (None: none may)
    done(t)   ──> what waited for ``t`` may run

Ordered per conversation, not globally: the next turn of a conversation extends the
prompt of the one before (its prompt, its answer, a new message), and is sent once that
answer went out, after its store was queued: so its match finds that store done. Tasks
of unrelated prompts, and every task of another tenant, never wait for each other (a
task only comes after tasks of its own owner or scope, and a scope is one tenant's).

A tenant whose tier stalls holds at most ``per_tenant`` workers, whatever it queues;
``workers // per_tenant - 1`` tenants stalled at once still leave every other tenant
its ``per_tenant`` workers. NOTE: that is the bound on a stalled tier's hold: which
tiers a match will touch (a shared tier's probe) is decided inside the cache, under its
lock, so no per-tier limit can be applied before the task runs.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prefixcache.engine.inflight import common_prefix

__all__ = ["IOQueue", "Kind", "Task", "extends"]

T = TypeVar("T")


class Kind(enum.Enum):
    """What a task does to the cache: a stage reads what stores before it wrote."""

    STAGE = "stage"  # match + load (a shared tier's probe among them)
    STORE = "store"  # insert


@dataclass(eq=False, slots=True)
class Task(Generic[T]):
    """One queued task: ``item`` is what the worker runs, the rest what orders it."""

    item: T
    owner: Hashable  # its job: one job's tasks run in the order they came
    tenant: str
    scope: Hashable  # its cache context: a stage waits only for stores of the same context
    prompt: Sequence[int]
    kind: Kind
    waits: int = 0  # tasks it comes after that are not done yet
    then: list[Task[T]] = field(default_factory=list)  # tasks that come after it, not run yet
    running: bool = False
    done: bool = False


def extends(prompt: Sequence[int], base: Sequence[int]) -> bool:
    """Whether ``prompt`` starts with all of ``base`` (a later turn of its conversation)."""
    n = len(base)
    if n == 0 or n > len(prompt) or prompt[n - 1] != base[n - 1] or prompt[0] != base[0]:
        return False  # NOTE: the cheap checks first; most pending stores fail one of them
    return common_prefix(prompt, base) == n


class IOQueue(Generic[T]):
    """The pending and running cache tasks (not thread-safe: ``CacheIO`` holds its lock)."""

    def __init__(self, workers: int, per_tenant: int) -> None:
        if workers < 1 or per_tenant < 1:
            raise ValueError(f"workers and per_tenant must be >= 1, got {workers}, {per_tenant}")
        self.workers = workers
        self.per_tenant = min(per_tenant, workers)
        self._pending: list[Task[T]] = []  # not running yet, in arrival order
        self._last: dict[Hashable, Task[T]] = {}  # each owner's last task not done
        self._stores: dict[Hashable, list[Task[T]]] = {}  # each scope's stores not done
        self._busy: dict[str, int] = {}  # tasks running, by tenant
        self._running = 0

    def put(
        self, item: T, *, owner: Hashable, tenant: str, scope: Hashable, prompt: Sequence[int], kind: Kind
    ) -> Task[T]:
        task = Task(item, owner, tenant, scope, prompt, kind)
        last = self._last.get(owner)
        before = [last] if last is not None else []
        if kind is Kind.STAGE:
            before += (s for s in self._stores.get(scope, ()) if s is not last and extends(prompt, s.prompt))
        for earlier in before:
            earlier.then.append(task)
        task.waits = len(before)
        self._pending.append(task)
        self._last[owner] = task
        if kind is Kind.STORE:
            self._stores.setdefault(scope, []).append(task)
        return task

    def take(self) -> Task[T] | None:
        """The next task to run, now marked running; None when none may run now."""
        if self._running >= self.workers:
            return None
        for i, task in enumerate(self._pending):
            if not task.waits and self._busy.get(task.tenant, 0) < self.per_tenant:
                del self._pending[i]
                task.running = True
                self._running += 1
                self._busy[task.tenant] = self._busy.get(task.tenant, 0) + 1
                return task
        return None

    def done(self, task: Task[T]) -> None:
        """``task`` ran (or failed): what came after it may run."""
        if not task.running or task.done:
            raise ValueError("only a running task can be done")
        task.running, task.done = False, True
        for later in task.then:
            later.waits -= 1
        task.then = []  # NOTE: a done task holds nothing that runs later, nor is held by it
        self._running -= 1
        busy = self._busy[task.tenant] - 1
        if busy:
            self._busy[task.tenant] = busy
        else:
            del self._busy[task.tenant]
        if self._last.get(task.owner) is task:
            del self._last[task.owner]
        if task.kind is Kind.STORE:
            stores = self._stores[task.scope]
            stores.remove(task)
            if not stores:
                del self._stores[task.scope]

    # ------------------------------------------------------------------ state

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return self._running

    def busy(self, tenant: str) -> int:
        """Tasks of ``tenant`` running now."""
        return self._busy.get(tenant, 0)

    @property
    def idle(self) -> bool:
        return not self._pending and not self._running
