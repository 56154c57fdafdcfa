"""Which request the engine works on next: per-tenant queues, per-tenant admission
limits, and round robin over the requests in flight.

    submit ──> admit(job) ──> waiting:  acme [a3 a4]   globex [g2]        (max_queue, all tenants)
                                 │ a free slot goes to the next tenant in turn (max_active slots;
                                 │ a tenant holding h of them takes another only while more than h are free)
                                 │ while the job picked fits the KV budget (kv_budget); one that does not
                                 │ waits, and the filling with it: no later job passes it
                                 v
                              active:   acme [a1 a2]   globex [g1]
                                 │ next(): acme, globex, acme, ...; a1, a2 in turn within acme
                                 v
                              worker: started() -> stage; next(ready) -> a prefill step;
                                      the batch decodes the rest ... finish(job)

The scheduler knows a job only as ``Work`` (a tenant, a prompt length and the KV memory
it reserves while in flight, ``memory.py``); what one
step is (a prefill chunk) is the job's business (``job.py``), and the decoding jobs
step together in the batch (``loop.py``).
Submitting threads and the worker share it behind one lock, under which no model work
or I/O ever runs.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from prefixcache.engine.requests import EngineClosed, QueueFull, TenantBusy

__all__ = ["Admission", "Order", "Scheduler", "SchedulerConfig", "TenantLimits", "TenantLoad", "Work"]


class Order(enum.Enum):
    """Which waiting request takes a free slot."""

    FAIR = "fair"  # the tenants with waiting requests in turn, each tenant's own in arrival order
    FIFO = "fifo"  # arrival order across tenants: one queue, as the engine had before (for comparisons)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's share of the engine; None: no limit."""

    max_concurrent: int | None = None  # its requests queued or running
    max_queued_tokens: int | None = None  # their prompt tokens (a request alone is always let in)

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass(frozen=True, slots=True)
class Admission:
    """Every tenant's limits: ``tenants`` by name, the rest ``default``."""

    default: TenantLimits = TenantLimits()
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_queue: int = 64  # requests waiting for a slot, all tenants together; more get QueueFull
    max_active: int = 2  # requests in flight, each holding its own KV
    order: Order = Order.FAIR
    admission: Admission = Admission()
    kv_budget: int | None = None  # bytes the jobs in flight may reserve together (``Work.kv_bytes``); None: any

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_active < 1:
            raise ValueError(f"max_queue and max_active must be >= 1, got {self.max_queue}, {self.max_active}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"kv_budget must be >= 1 or None, got {self.kv_budget}")


@dataclass(frozen=True, slots=True)
class TenantLoad:
    waiting: int
    active: int
    tokens: int  # prompt tokens of those


class Work(Protocol):
    """What the scheduler knows of a job."""

    @property
    def tenant(self) -> str: ...

    @property
    def tokens(self) -> int: ...  # prompt tokens, counted against the tenant's max_queued_tokens

    @property
    def kv_bytes(self) -> int: ...  # KV memory reserved while in flight, counted against kv_budget


J = TypeVar("J", bound=Work)


@dataclass(eq=False, slots=True)
class _Tenant(Generic[J]):
    waiting: deque[tuple[int, J]] = field(default_factory=deque)  # (arrival number, job)
    active: deque[J] = field(default_factory=deque)  # the next to step first
    tokens: int = 0  # prompt tokens of its jobs, waiting or active

    @property
    def jobs(self) -> int:
        return len(self.waiting) + len(self.active)


class Scheduler(Generic[J]):
    """Admission, per-tenant queues and the choice of the next job to step (thread-safe)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._cond = threading.Condition()
        self._tenants: dict[str, _Tenant[J]] = {}
        self._queued: deque[str] = deque()  # tenants with waiting jobs, the next to get a slot first
        self._turns: deque[str] = deque()  # tenants with active jobs, the next to step first
        self._last: str | None = None  # the tenant stepped last
        self._arrivals = 0
        self._waiting = 0
        self._active = 0
        self._reserved = 0  # kv_bytes of the active jobs
        self._stalled = False  # the job picked next waits for memory: no other may start
        self._closed = False
        self._busy_since = 0.0
        self._last_end = 0.0
        self._gap_s = 1.0  # a running estimate of the seconds between two jobs' ends while busy
        self._started: list[J] = []  # took a slot, not yet handed to the worker
        self._version = 0  # bumped on every change the worker waits for

    # ------------------------------------------------------------------ submitting threads

    def admit(self, job: J) -> None:
        """Queue ``job``; raises ``TenantBusy`` (its tenant's limits), ``QueueFull`` or ``EngineClosed``."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            budget = self.config.kv_budget
            if budget is not None and job.kv_bytes > budget:  # NOTE: it would wait forever; the engine refuses it first
                raise ValueError(f"a job reserving {job.kv_bytes} bytes never fits kv_budget = {budget}")
            tenant = self._tenants.get(job.tenant) or _Tenant()
            self._check(job, tenant)
            self._tenants[job.tenant] = tenant
            if not tenant.waiting:
                self._queued.append(job.tenant)
            self._arrivals += 1
            tenant.waiting.append((self._arrivals, job))
            tenant.tokens += job.tokens
            self._waiting += 1
            self._fill()
            self._version += 1
            self._cond.notify_all()

    def _check(self, job: J, tenant: _Tenant[J]) -> None:
        limits = self.config.admission.limits(job.tenant)
        if limits.max_concurrent is not None and tenant.jobs >= limits.max_concurrent:
            raise TenantBusy(
                f"this tenant has {tenant.jobs} requests queued or running, its limit (max_concurrent = "
                f"{limits.max_concurrent}); retry later",
                self.retry_after(),
            )
        over = limits.max_queued_tokens is not None and tenant.tokens + job.tokens > limits.max_queued_tokens
        if over and tenant.jobs:
            raise TenantBusy(
                f"this tenant's requests queued or running hold {tenant.tokens} prompt tokens; with this one's "
                f"{job.tokens} that is over its limit (max_queued_tokens = {limits.max_queued_tokens}); retry later",
                self.retry_after(),
            )
        free = self.config.max_active - self._active
        # NOTE: jobs that wait now cannot take a free slot (_fill gave every one it could),
        # and none can while the one picked next waits for memory
        fair = not self._waiting if self.config.order is Order.FIFO else len(tenant.active) < free
        starts = free > 0 and fair and not self._stalled and self._fits(job)
        if self._waiting >= self.config.max_queue and not starts:
            raise QueueFull(
                f"the server is busy ({self._waiting + 1} requests waiting); retry later", self.retry_after()
            )

    def retry_after(self) -> int:
        """Seconds until a slot likely frees: about the time between two jobs' ends."""
        return max(1, math.ceil(self._gap_s))

    # ------------------------------------------------------------------ the worker

    def started(self) -> list[J]:
        """The jobs that took a slot since the last call, in the order they took it."""
        with self._cond:
            out, self._started = self._started, []
            return out

    def next(self, ready: Callable[[J], bool]) -> J | None:
        """The active job to step next among those ``ready`` says can step: the tenants
        in turn, each tenant's jobs in turn; None when none can (it does not wait)."""
        with self._cond:
            for _ in range(len(self._turns)):
                name = self._turns[0]
                self._turns.rotate(-1)
                active = self._tenants[name].active
                for _ in range(len(active)):
                    job = active[0]
                    active.rotate(-1)
                    if ready(job):
                        self._last = name
                        return job
            return None

    def poke(self) -> None:
        """Something changed that the worker waits for (a job became ready)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    @property
    def version(self) -> int:
        """Counts the changes the worker waits for: read it before looking for work."""
        return self._version

    def wait(self, seen: int, timeout: float | None = None) -> bool:
        """Wait until a change after ``seen`` (``version``), or ``timeout``; False once
        closed with nothing queued or in flight (the worker's end)."""
        with self._cond:
            if self._closed and not self._waiting and not self._active:
                return False
            self._cond.wait_for(lambda: self._version != seen, timeout)
            return not (self._closed and not self._waiting and not self._active)

    def finish(self, job: J) -> None:
        """``job`` ended (its last step ran): its slot and its share go to the next."""
        with self._cond:
            tenant = self._tenants[job.tenant]
            tenant.active.remove(job)
            self._active -= 1
            self._reserved -= job.kv_bytes
            if not tenant.active:
                self._turns.remove(job.tenant)
            self._release(job, tenant)
            now = self._clock()
            self._gap_s = 0.8 * self._gap_s + 0.2 * (now - max(self._last_end, self._busy_since))
            self._last_end = now
            self._fill()
            self._version += 1
            self._cond.notify_all()

    def reap(self, gone: Callable[[J], bool]) -> list[J]:
        """Take out the waiting jobs for which ``gone`` holds (past their deadline), so
        that they end now rather than when a slot frees."""
        with self._cond:
            out: list[J] = []
            for name, tenant in list(self._tenants.items()):
                ended = [entry for entry in tenant.waiting if gone(entry[1])]
                if ended:
                    tenant.waiting = deque(entry for entry in tenant.waiting if entry not in ended)
                    out += self._drop(name, tenant, ended)
            if out:  # NOTE: one of them may have been the job waiting for memory
                self._fill()
                self._version += 1
                self._cond.notify_all()
            return out

    def close(self) -> list[J]:
        """Take no more jobs; the waiting ones are returned (to be ended), the active run on."""
        with self._cond:
            self._closed = True
            out: list[J] = []
            for name, tenant in list(self._tenants.items()):
                ended, tenant.waiting = list(tenant.waiting), deque()
                out += self._drop(name, tenant, ended)
            self._stalled = False
            self._version += 1
            self._cond.notify_all()
            return out

    # ------------------------------------------------------------------ state

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def active(self) -> int:
        return self._active

    @property
    def reserved(self) -> int:
        """The KV memory the active jobs reserve (``Work.kv_bytes``), against ``kv_budget``."""
        return self._reserved

    def load(self) -> dict[str, TenantLoad]:
        """Each tenant's jobs in the engine now, for stats and tests."""
        with self._cond:
            return {n: TenantLoad(len(t.waiting), len(t.active), t.tokens) for n, t in self._tenants.items()}

    # ------------------------------------------------------------------ under the lock

    def _fill(self) -> None:
        """Give free slots to waiting jobs, while the one picked next fits the memory left."""
        self._stalled = False
        while self._active < self.config.max_active:
            name = self._pick()
            if name is None:
                return
            tenant = self._tenants[name]
            job = tenant.waiting[0][1]
            if not self._fits(job):
                # NOTE: its tenant goes back to the head of the turns, so that it is picked
                # first when memory frees, before any job that came after it
                if self.config.order is Order.FAIR:
                    self._queued.rotate(1)
                self._stalled = True
                return
            tenant.waiting.popleft()
            if not tenant.waiting:
                self._queued.remove(name)
            self._waiting -= 1
            if self._active == 0:
                self._busy_since = self._clock()
            self._active += 1
            self._reserved += job.kv_bytes
            if not tenant.active:
                self._enter(name)
            tenant.active.append(job)
            self._started.append(job)

    def _fits(self, job: J) -> bool:
        budget = self.config.kv_budget
        return budget is None or self._reserved + job.kv_bytes <= budget

    def _pick(self) -> str | None:
        """The tenant whose waiting job takes the next free slot."""
        if self.config.order is Order.FIFO:
            heads = ((t.waiting[0][0], name) for name, t in self._tenants.items() if t.waiting)
            return min(heads, default=(0, None))[1]
        free = self.config.max_active - self._active
        for _ in range(len(self._queued)):
            name = self._queued[0]
            self._queued.rotate(-1)
            # NOTE: holding h slots, a tenant takes another only while more than h are free,
            # so a tenant alone never fills every slot and one that arrives finds room at once
            if len(self._tenants[name].active) < free:
                return name
        return None

    def _enter(self, name: str) -> None:
        """A tenant with a first active job joins the turns: before the one stepped last
        when that one is still in them (so it steps within one step), else at the end."""
        if self._turns and self._turns[-1] == self._last:
            self._turns.insert(len(self._turns) - 1, name)
        else:
            self._turns.append(name)

    def _release(self, job: J, tenant: _Tenant[J]) -> None:
        tenant.tokens -= job.tokens
        if not tenant.jobs:
            del self._tenants[job.tenant]

    def _drop(self, name: str, tenant: _Tenant[J], ended: list[tuple[int, J]]) -> list[J]:
        """Account for ``ended``, already out of ``tenant``'s waiting jobs."""
        self._waiting -= len(ended)
        if ended and not tenant.waiting:
            self._queued.remove(name)
        tenant.tokens -= sum(job.tokens for _, job in ended)
        if not tenant.jobs:
            del self._tenants[name]
        return [job for _, job in ended]
