"""The I/O workers' queue alone (no threads, no cache), under any order of puts, takes
and dones: one job's tasks run in the order they came; a stage never runs before a store
of its conversation (same scope, a prompt it extends) that is not done; at most
``workers`` run, at most ``per_tenant`` of one tenant; nothing waits for a task of
another tenant or of an unrelated prompt; something pending can always run when nothing
runs (no deadlock); and the bookkeeping (running, busy, idle) matches what ran."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.engine.ioqueue import IOQueue, Kind, Task, extends

TENANTS = ("acme", "globex", "initech")
OWNERS = 5  # jobs, each of one tenant
SCOPES = 2  # cache contexts a tenant has (a scope is one tenant's)
BASES = ((1, 2), (1, 3), (7,))  # first tokens of the prompts: with the tails, many extend others


@dataclass(eq=False)
class Put:
    """What the test knows of a task it put (the reference the queue is checked against)."""

    task: Task[int]
    owner: int
    tenant: str
    scope: tuple[str, int]
    prompt: tuple[int, ...]
    kind: Kind
    state: str = "pending"  # pending, running, done


def prefix_of(prompt: tuple[int, ...], base: tuple[int, ...]) -> bool:
    """The reference for ``extends``: ``base`` is a non-empty prefix of ``prompt``."""
    return 0 < len(base) <= len(prompt) and prompt[: len(base)] == base


class QueueMachine(RuleBasedStateMachine):
    """Puts, takes and dones in any order, checked against the rules written out plainly."""

    @initialize(workers=st.integers(1, 4), per_tenant=st.integers(1, 3))
    def start(self, workers: int, per_tenant: int) -> None:
        self.queue: IOQueue[int] = IOQueue(workers, per_tenant)
        self.workers, self.per_tenant = workers, min(per_tenant, workers)
        self.puts: list[Put] = []
        self.ran: list[Put] = []  # in the order they were taken

    # ------------------------------------------------------------------ the reference

    def blockers(self, put: Put) -> list[Put]:
        """The tasks ``put`` comes after that are not done: its owner's earlier ones and,
        for a stage, its scope's earlier stores whose prompt its own extends."""
        earlier = self.puts[: self.puts.index(put)]
        return [
            e
            for e in earlier
            if e.state != "done"
            and (
                e.owner == put.owner
                or (
                    put.kind is Kind.STAGE
                    and e.kind is Kind.STORE
                    and e.scope == put.scope
                    and prefix_of(put.prompt, e.prompt)
                )
            )
        ]

    def busy(self, tenant: str) -> int:
        return sum(1 for p in self.puts if p.state == "running" and p.tenant == tenant)

    def may_run(self, put: Put) -> bool:
        running = sum(1 for p in self.puts if p.state == "running")
        return (
            put.state == "pending"
            and not self.blockers(put)
            and self.busy(put.tenant) < self.per_tenant
            and running < self.workers
        )

    # ------------------------------------------------------------------ rules

    @rule(
        owner=st.integers(0, OWNERS - 1),
        scope=st.integers(0, SCOPES - 1),
        base=st.sampled_from(BASES),
        tail=st.lists(st.integers(1, 2), max_size=2),
        kind=st.sampled_from(Kind),
    )
    def put(self, owner: int, scope: int, base: tuple[int, ...], tail: list[int], kind: Kind) -> None:
        tenant = TENANTS[owner % len(TENANTS)]  # NOTE: a job is always of one tenant
        prompt = (*base, *tail)
        n = len(self.puts)
        task = self.queue.put(n, owner=owner, tenant=tenant, scope=(tenant, scope), prompt=prompt, kind=kind)
        self.puts.append(Put(task, owner, tenant, (tenant, scope), prompt, kind))

    @rule()
    def take(self) -> None:
        eligible = [p for p in self.puts if self.may_run(p)]
        task = self.queue.take()
        if task is None:
            # nothing that may run is held back: not by a waiting task, another tenant's, an unrelated prompt's
            assert not eligible, [(p.tenant, p.prompt, p.kind) for p in eligible]
            return
        put = self.puts[task.item]
        assert put is eligible[0], "the first task in arrival order that may run"
        assert all(e.state == "done" for e in self.puts[: task.item] if e.owner == put.owner)
        put.state = "running"
        self.ran.append(put)

    @precondition(lambda self: any(p.state == "running" for p in self.puts))
    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        running = [p for p in self.puts if p.state == "running"]
        put = data.draw(st.sampled_from(running))
        self.queue.done(put.task)
        put.state = "done"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def limits_hold(self) -> None:
        running = [p for p in self.puts if p.state == "running"]
        assert len(running) <= self.workers
        for tenant in TENANTS:
            assert self.busy(tenant) == self.queue.busy(tenant) <= self.per_tenant

    @invariant()
    def bookkeeping_matches(self) -> None:
        pending = sum(1 for p in self.puts if p.state == "pending")
        running = sum(1 for p in self.puts if p.state == "running")
        assert (self.queue.pending, self.queue.running) == (pending, running)
        assert self.queue.idle == (pending == running == 0)
        for p in self.puts:
            assert (p.task.running, p.task.done) == (p.state == "running", p.state == "done")
            if p.state == "done":
                assert not p.task.then  # a done task holds nothing that runs later

    @invariant()
    def progress(self) -> None:
        """When nothing runs, what is pending can start: the first pending task at least."""
        pending = [p for p in self.puts if p.state == "pending"]
        if pending and not any(p.state == "running" for p in self.puts):
            assert self.may_run(pending[0])

    def teardown(self) -> None:
        """Run everything left, one at a time: it all runs, once, in an order that keeps the rules."""
        if not hasattr(self, "queue"):
            return
        for p in self.puts:
            if p.state == "running":
                self.queue.done(p.task)
                p.state = "done"
        while (task := self.queue.take()) is not None:
            put = self.puts[task.item]
            assert not self.blockers(put)
            self.queue.done(task)
            put.state = "done"
        assert self.queue.idle
        assert all(p.state == "done" for p in self.puts)


TestQueue = QueueMachine.TestCase
TestQueue.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- examples


def stage(queue: IOQueue[str], name: str, owner: object, tenant: str, prompt: list[int]) -> Task[str]:
    return queue.put(name, owner=owner, tenant=tenant, scope=tenant, prompt=prompt, kind=Kind.STAGE)


def store(queue: IOQueue[str], name: str, owner: object, tenant: str, prompt: list[int]) -> Task[str]:
    return queue.put(name, owner=owner, tenant=tenant, scope=tenant, prompt=prompt, kind=Kind.STORE)


def test_the_next_turn_waits_for_its_conversations_store_and_nothing_else_does() -> None:
    queue: IOQueue[str] = IOQueue(workers=4, per_tenant=4)
    first = [1, 2, 3, 4]
    saved = store(queue, "turn 1 store", "job 1", "acme", first)
    assert queue.take() is saved  # its store runs (slowly)
    stage(queue, "turn 2", "job 2", "acme", [*first, 5, 6])  # the answer and a new message
    stage(queue, "unrelated", "job 3", "acme", [9, 9, 9])
    stage(queue, "other tenant", "job 4", "globex", [*first, 5, 6])  # the same tokens, another tenant
    ran = [queue.take(), queue.take(), queue.take()]
    assert [t.item if t else None for t in ran] == ["unrelated", "other tenant", None]
    queue.done(saved)
    later = queue.take()
    assert later is not None and later.item == "turn 2"


def test_a_tenant_holds_at_most_per_tenant_workers_whatever_it_queues() -> None:
    queue: IOQueue[str] = IOQueue(workers=3, per_tenant=2)
    for i in range(5):
        stage(queue, f"a{i}", f"ja{i}", "acme", [i, 1])
    stage(queue, "b", "jb", "globex", [1, 1])
    taken = [queue.take() for _ in range(3)]
    assert [t.item if t else None for t in taken] == ["a0", "a1", "b"]
    assert queue.busy("acme") == 2 and queue.take() is None  # acme's stalled two hold only theirs


def test_extends_and_the_limits() -> None:
    assert extends([1, 2, 3], [1, 2]) and extends([1, 2], [1, 2])
    assert not extends([1, 2], [1, 2, 3]) and not extends([1, 3, 3], [1, 2, 3]) and not extends([1], [])
    with pytest.raises(ValueError):
        IOQueue(0, 1)
    with pytest.raises(ValueError):
        IOQueue(1, 0)
    assert IOQueue(2, 5).per_tenant == 2
    queue: IOQueue[str] = IOQueue(1, 1)
    task = stage(queue, "x", "j", "acme", [1])
    with pytest.raises(ValueError):
        queue.done(task)  # not running
