"""The scheduler alone (no model), under any interleaving of submissions, steps, ends
and callers that leave: every admitted job ends exactly once, tenants are stepped in
turn (none starves), and the limits hold: per tenant, in the queue, in flight, in KV
memory (a job that does not fit waits, and no later job passes it). And the
``[admission]`` settings that set those limits."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.engine.memory import default_budget, machine_memory
from prefixcache.engine.requests import EngineClosed, QueueFull, TenantBusy
from prefixcache.engine.scheduler import Admission, Order, Scheduler, SchedulerConfig, TenantLimits
from prefixcache.settings import load_settings
from prefixcache.settings.admission import AdmissionSettings, TenantAdmission

TENANTS = ("a", "b", "c")
KV_MAX = 100  # the most a fake job reserves


@dataclass(eq=False)
class FakeJob:
    tenant: str
    tokens: int
    steps: int  # steps until it ends
    stepped: int = 0
    ended: int = 0
    gone: bool = False  # its caller left
    kv_bytes: int = 0  # what it reserves while in flight


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


limits = st.builds(TenantLimits, st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(50, 400)))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        max_active=st.integers(1, 4),
        max_queue=st.integers(1, 6),
        order=st.sampled_from(Order),
        default=limits,
        b=limits,
        budget=st.one_of(st.none(), st.integers(KV_MAX, 3 * KV_MAX)),
    )
    def setup(
        self, max_active: int, max_queue: int, order: Order, default: TenantLimits, b: TenantLimits, budget: int | None
    ) -> None:
        self.config = SchedulerConfig(max_queue, max_active, order, Admission(default, {"b": b}), budget)
        self.clock = Clock()
        self.sched: Scheduler[FakeJob] = Scheduler(self.config, self.clock)
        self.admitted: list[FakeJob] = []
        self.index = 0  # steps so far
        self.last_step: dict[str, int] = {}
        self.active_since: dict[str, int] = {}  # tenants in flight: since which step
        self.arrival: dict[int, int] = {}  # id(job) -> order of admission
        self.first: dict[int, int] = {}  # id(job) -> the step that started it
        self.started: list[FakeJob] = []  # in the order they took a slot

    # ------------------------------------------------------------------ rules

    @rule(
        tenant=st.sampled_from(TENANTS),
        tokens=st.integers(1, 300),
        steps=st.integers(1, 4),
        kv=st.integers(1, KV_MAX),
    )
    def submit(self, tenant: str, tokens: int, steps: int, kv: int) -> None:
        job = FakeJob(tenant, tokens, steps, kv_bytes=kv)
        before = self.sched.load().get(tenant)
        jobs = 0 if before is None else before.waiting + before.active
        held = 0 if before is None else before.tokens
        waiting = self.sched.waiting
        limit = self.config.admission.limits(tenant)
        try:
            self.sched.admit(job)
        except TenantBusy:
            over_count = limit.max_concurrent is not None and jobs >= limit.max_concurrent
            over_tokens = limit.max_queued_tokens is not None and jobs > 0 and held + tokens > limit.max_queued_tokens
            assert over_count or over_tokens
            return
        except QueueFull:
            assert waiting >= self.config.max_queue
            return
        assert limit.max_concurrent is None or jobs < limit.max_concurrent
        assert limit.max_queued_tokens is None or jobs == 0 or held + tokens <= limit.max_queued_tokens
        self.arrival[id(job)] = len(self.admitted)
        self.admitted.append(job)
        self._track()

    @precondition(lambda self: self.sched.active > 0)
    @rule()
    def step(self) -> None:
        self.clock.now += 1.0
        job = self.sched.next(ANY)
        assert job is not None and not job.ended and not job.gone
        self._check_turn(job.tenant)
        if not job.stepped:
            self.first[id(job)] = self.index
        job.stepped += 1
        if job.stepped == job.steps:
            job.ended += 1
            self.sched.finish(job)
        self._track()

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """Some callers leave; the waiting ones among them are reaped, unstarted."""
        living = [j for j in self.admitted if not j.ended and not j.gone]
        if not living:
            return
        for job in data.draw(st.lists(st.sampled_from(living), max_size=3)):
            job.gone = True
        reaped = self.sched.reap(lambda j: j.gone)
        for job in reaped:
            assert job.gone and job.stepped == 0 and not job.ended
            job.ended += 1
        self._track()
        for job in self.admitted:
            if job.gone and not job.ended:
                job.gone = False  # in flight: it ends by its own steps (the engine's job sees the cancel)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def limits_hold(self) -> None:
        if not hasattr(self, "sched"):
            return
        load = self.sched.load()
        assert self.sched.active <= self.config.max_active
        assert self.sched.waiting <= self.config.max_queue
        assert sum(t.active for t in load.values()) == self.sched.active
        assert sum(t.waiting for t in load.values()) == self.sched.waiting
        for tenant, t in load.items():
            limit = self.config.admission.limits(tenant)
            jobs = t.waiting + t.active
            assert limit.max_concurrent is None or jobs <= limit.max_concurrent
            assert limit.max_queued_tokens is None or jobs <= 1 or t.tokens <= limit.max_queued_tokens
            living = [j for j in self.admitted if j.tenant == tenant and not j.ended]
            assert jobs == len(living) and t.tokens == sum(j.tokens for j in living)
        active = [j for j in self.started if not j.ended]
        assert self.sched.reserved == sum(j.kv_bytes for j in active) and len(active) == self.sched.active
        assert self.config.kv_budget is None or self.sched.reserved <= self.config.kv_budget

    @invariant()
    def slots_are_used_and_shared(self) -> None:
        if not hasattr(self, "sched"):
            return
        load, free = self.sched.load(), self.config.max_active - self.sched.active
        if self.config.order is Order.FIFO:
            assert self.sched.waiting == 0 or free == 0 or self._stalled()  # a waiting job: no slot or no memory
            return
        for t in load.values():
            if t.waiting and not self._stalled():
                assert t.active >= free  # a waiting job's tenant holds as many slots as are free
            if self.config.max_active > 1:
                assert t.active < self.config.max_active  # no tenant alone fills every slot

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        bound = sum(j.steps for j in self.admitted) + 1
        for _ in range(bound):  # everything admitted ends in at most its own steps
            if self.sched.active == 0:
                break
            self.step()
        assert self.sched.active == 0 and self.sched.waiting == 0
        assert all(j.ended == 1 for j in self.admitted)
        assert all(j.stepped in (0, j.steps) for j in self.admitted)
        if self.config.order is Order.FIFO:  # slots taken in the order they came, whatever their size
            assert [self.arrival[id(j)] for j in self.started] == sorted(self.arrival[id(j)] for j in self.started)
        assert self.sched.next(ANY) is None
        assert self.sched.close() == []
        assert not self.sched.wait(self.sched.version, 0)  # closed and empty: the worker stops

    # ------------------------------------------------------------------ helpers

    def _check_turn(self, tenant: str) -> None:
        """Round robin: between two steps of ``tenant``, every tenant in flight the whole
        time got a step too."""
        previous = self.last_step.get(tenant)
        if previous is not None and self.active_since.get(tenant, self.index + 1) <= previous:
            for other, since in self.active_since.items():
                if other != tenant and since <= previous:
                    assert self.last_step.get(other, -1) > previous, (tenant, other, previous, self.index)
        self.last_step[tenant] = self.index
        self.index += 1

    def _stalled(self) -> bool:
        """Whether a waiting job that is the next of its tenant does not fit the memory left."""
        budget = self.config.kv_budget
        if budget is None:
            return False
        waiting = [j for j in self.admitted if not j.ended and not j.gone and j not in self.started]
        heads = {j.tenant: j for j in reversed(waiting)}  # each tenant's first
        return any(self.sched.reserved + j.kv_bytes > budget for j in heads.values())

    def _track(self) -> None:
        self.started += self.sched.started()
        for name, t in self.sched.load().items():
            if t.active and name not in self.active_since:
                self.active_since[name] = self.index
        for name in list(self.active_since):
            t = self.sched.load().get(name)
            if t is None or not t.active:
                del self.active_since[name]


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase


def ANY(job: FakeJob) -> bool:
    return True


def test_next_skips_the_jobs_not_ready_and_keeps_the_turns() -> None:
    """A job whose prefix is still loading (the engine's I/O thread) gives its turn to the
    next ready one; the scheduler never waits for it."""
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4))
    a, b = FakeJob("a", 10, 3), FakeJob("b", 10, 3)
    sched.admit(a)
    sched.admit(b)
    assert sched.started() == [a, b] and sched.started() == []
    assert sched.next(lambda job: job is b) is b
    assert sched.next(lambda job: False) is None
    assert [sched.next(ANY) for _ in range(3)] == [a, b, a]
    seen = sched.version
    sched.poke()  # a change the worker waits for
    assert sched.version != seen
    assert sched.wait(seen, 0)  # open: the worker goes on
    sched.close()
    assert sched.wait(sched.version, 0)  # closed with jobs in flight: it goes on
    sched.finish(a)
    sched.finish(b)
    assert not sched.wait(sched.version, 0)  # closed and empty: it stops


def test_tenants_take_turns_and_a_newcomer_steps_next() -> None:
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4))
    heavy = [FakeJob("heavy", 100, 10) for _ in range(3)]
    for job in heavy:
        sched.admit(job)
    assert sched.load()["heavy"].active == 2  # a tenant alone leaves room for others
    order = [sched.next(ANY) for _ in range(3)]
    assert order == [heavy[0], heavy[1], heavy[0]]  # its own jobs in turn
    light = FakeJob("light", 5, 1)
    sched.admit(light)
    assert sched.next(ANY) is light  # within one step of arriving
    sched.finish(light)
    assert [sched.next(ANY) for _ in range(2)] == [heavy[1], heavy[0]]


def test_a_tenant_that_keeps_coming_back_does_not_starve_the_others() -> None:
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=2))
    heavy = FakeJob("heavy", 100, 10)
    sched.admit(heavy)
    steps = Counter[str]()
    for _ in itertools.repeat(None, 6):  # light's requests end in one step and come back at once
        sched.admit(FakeJob("light", 5, 1))
        for _ in range(2):
            job = sched.next(ANY)
            assert job is not None
            steps[job.tenant] += 1
            if job.tenant == "light":
                sched.finish(job)
    assert steps == {"heavy": 6, "light": 6}


def test_limits_refuse_with_the_limit_named_and_a_retry_hint() -> None:
    clock = Clock()
    admission = Admission(TenantLimits(2, 1000), {"acme": TenantLimits(max_concurrent=3)})
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=10, max_active=1, admission=admission), clock)
    sched.admit(FakeJob("globex", 600, 1))
    with pytest.raises(TenantBusy, match="max_queued_tokens = 1000") as busy:
        sched.admit(FakeJob("globex", 600, 1))
    assert busy.value.status == 429 and busy.value.retry_after >= 1 and busy.value.code == "tenant_busy"
    sched.admit(FakeJob("globex", 400, 1))
    with pytest.raises(TenantBusy, match="max_concurrent = 2"):
        sched.admit(FakeJob("globex", 1, 1))
    for _ in range(3):
        sched.admit(FakeJob("acme", 1, 1))  # its own limit
    with pytest.raises(TenantBusy, match="max_concurrent = 3"):
        sched.admit(FakeJob("acme", 1, 1))
    sched.admit(FakeJob("initech", 5000, 1))  # a request alone always fits
    for _ in range(5):  # a slot frees every 4 s
        clock.now += 4.0
        job = sched.next(ANY)
        assert job is not None
        sched.finish(job)
    with pytest.raises(TenantBusy) as busy:
        for _ in range(4):
            sched.admit(FakeJob("acme", 1, 1))
    assert 3 <= busy.value.retry_after <= 4  # about the time between two ends
    sched.close()
    with pytest.raises(EngineClosed):
        sched.admit(FakeJob("umbrella", 1, 1))


def sized(tenant: str, kv_bytes: int) -> FakeJob:
    """A job of one step that reserves ``kv_bytes``."""
    return FakeJob(tenant, 10, 1, kv_bytes=kv_bytes)


def test_a_job_waits_while_the_memory_is_reserved_and_starts_when_one_ends() -> None:
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4, kv_budget=100))
    a, b, c = sized("a", 60), sized("b", 40), sized("c", 30)
    for job in (a, b, c):
        sched.admit(job)
    assert sched.started() == [a, b] and sched.reserved == 100  # slots are free; memory is not
    assert (sched.active, sched.waiting) == (2, 1)
    sched.finish(b)
    assert sched.started() == [c] and sched.reserved == 90
    sched.finish(a)
    sched.finish(c)
    assert sched.reserved == 0 and sched.active == 0


def test_a_later_small_job_does_not_pass_a_waiting_big_one() -> None:
    """Not the same tenant's, not another's: the big one would never find room else."""
    for order in Order:
        sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4, order=order, kv_budget=100))
        running = sized("a", 50)
        big, mine, other = sized("b", 80), sized("b", 10), sized("c", 10)
        for job in (running, big, mine, other):
            sched.admit(job)
        assert sched.started() == [running], order  # 50 of 100 free: the small ones would fit, and wait
        late = sized("d", 1)
        sched.admit(late)  # a tenant that arrives later waits too
        assert sched.started() == [] and sched.waiting == 4
        sched.finish(running)
        assert sched.started() == ([big, other, late] if order is Order.FAIR else [big, mine, other]), order
        assert sched.reserved == (91 if order is Order.FAIR else 100)


def test_a_waiting_job_that_leaves_lets_the_next_start() -> None:
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4, kv_budget=100))
    running, big, small = sized("a", 50), sized("b", 80), sized("c", 10)
    for job in (running, big, small):
        sched.admit(job)
    assert sched.started() == [running]
    seen = sched.version
    assert sched.reap(lambda job: job is big) == [big]  # past its deadline
    assert sched.started() == [small] and sched.version != seen  # the worker is woken to stage it


def test_with_memory_to_spare_the_budget_changes_no_order() -> None:
    """The same submissions and ends, with a budget that never binds and with none: the
    same slots taken in the same order, the same steps."""

    def run(budget: int | None) -> list[tuple[str, int]]:
        sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=16, max_active=3, kv_budget=budget))
        trace: list[tuple[str, int]] = []
        jobs = [
            FakeJob(t, 10, steps, kv_bytes=10)
            for t, steps in zip("aabacbcaab", [2, 3, 1, 2, 1, 3, 2, 1, 1, 2], strict=True)
        ]
        for job in jobs[:6]:
            sched.admit(job)
        pending = jobs[6:]
        while sched.active:
            trace += [("start", jobs.index(j)) for j in sched.started()]
            job = sched.next(ANY)
            assert job is not None
            trace.append(("step", jobs.index(job)))
            job.stepped += 1
            if job.stepped == job.steps:
                sched.finish(job)
                if pending:
                    sched.admit(pending.pop(0))
        return trace

    assert run(None) == run(1000)
    assert run(1000) != run(20)  # a budget of two jobs does change it


def test_a_job_over_the_whole_budget_is_never_queued() -> None:
    sched: Scheduler[FakeJob] = Scheduler(SchedulerConfig(max_queue=8, max_active=4, kv_budget=100))
    with pytest.raises(ValueError, match="never fits kv_budget = 100"):  # the engine refuses it first (413)
        sched.admit(sized("a", 101))
    assert sched.waiting == 0


# ---------------------------------------------------------------------- [admission] settings


def test_admission_settings_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "prefixcache.toml"
    path.write_text(
        '[auth]\napi_keys = "sk-a=acme,sk-g=globex"\n'
        "[admission]\nmax_concurrent = 4\nmax_queued_tokens = 32768\nprefill_chunk_tokens = 128\nio_workers = 6\n"
        "[admission.tenants.acme]\nmax_concurrent = 8\n"
    )
    admission = load_settings(path, env={}).admission
    assert admission.admission().limits("acme") == TenantLimits(8, 32768)  # its own, the default for the rest
    assert admission.admission().limits("globex") == TenantLimits(4, 32768)
    args = admission.engine_args()
    assert (args["prefill_chunk_tokens"], args["max_active"], args["order"]) == (128, 32, Order.FAIR)
    assert (args["io_workers"], args["io_per_tenant"]) == (6, 2)  # the file's, the default
    env = {
        "PREFIXCACHE_ADMISSION_MAX_CONCURRENT": "2",
        "PREFIXCACHE_ADMISSION_ORDER": "fifo",
        "PREFIXCACHE_ADMISSION_TENANTS": '{"globex": {"max_queued_tokens": 1000}}',
    }
    by_env = load_settings(path, env=env).admission
    assert by_env.admission().limits("globex") == TenantLimits(2, 1000)
    assert by_env.admission().limits("acme") == TenantLimits(8, 32768)  # merged with the file's table, field by field
    assert by_env.engine_args()["order"] is Order.FIFO


def test_the_kv_budget_is_half_the_memory_unless_set(tmp_path: Path) -> None:
    assert default_budget(lambda: 8 << 30) == 4 << 30
    assert AdmissionSettings().engine_args()["kv_budget"] == default_budget()
    cgroup = Path("/sys/fs/cgroup/memory.max")
    if Path("/proc/meminfo").is_file() and not (cgroup.is_file() and cgroup.read_text().strip().isdigit()):
        total = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
        assert default_budget() == int(total.split()[1]) * 1024 // 2  # half of MemTotal
    path = tmp_path / "prefixcache.toml"
    path.write_text("[admission]\nkv_memory_bytes = 1073741824\n")
    assert load_settings(path, env={}).admission.engine_args()["kv_budget"] == 1 << 30
    env = {"PREFIXCACHE_ADMISSION_KV_MEMORY_BYTES": str(2 << 30)}
    assert load_settings(path, env=env).admission.engine_args()["kv_budget"] == 2 << 30


def test_the_memory_is_the_cgroup_limit_when_lower(tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    total = machine_memory(tmp_path / "none")
    limit.write_text("max\n")
    assert machine_memory(limit) == total
    limit.write_text(f"{1 << 30}\n")
    assert machine_memory(limit) == min(total, 1 << 30)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[admission]\nmax_concurrent = 0\n", "admission.max_concurrent"),
        ("[admission.tenants.acme]\nmax_queued_tokens = -5\n", "admission.tenants.acme.max_queued_tokens"),
        ("[admission]\norder = 'lifo'\n", "admission.order"),
        ("[admission]\nmax_concurent = 3\n", "admission.max_concurent"),
        ("[admission]\nkv_memory_bytes = 0\n", "admission.kv_memory_bytes"),
    ],
)
def test_bad_admission_settings_name_the_setting(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_settings(path, env={})


def test_limits_for_a_tenant_no_key_names_are_refused_at_start_up() -> None:
    admission = AdmissionSettings(tenants={"acme": TenantAdmission(max_concurrent=2), "acne": TenantAdmission()})
    with pytest.raises(ValueError, match=r"admission.tenants names \['acne'\], no tenant of this server"):
        admission.check_tenants({"acme", "globex"})
    env = {
        **os.environ,
        "PREFIXCACHE_AUTH_API_KEYS": "sk-a=acme",
        "PREFIXCACHE_ADMISSION_TENANTS": '{"acne": {"max_concurrent": 2}}',
    }
    serve = [str(Path(sys.executable).with_name("prefixcache")), "serve"]
    refused = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "admission.tenants names ['acne']" in refused.stderr
