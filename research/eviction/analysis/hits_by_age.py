import collections
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from research.eviction.policies import make
from research.eviction.sim import Policy, Sim
from research.eviction.traces import by_name, load

tname, cap = sys.argv[1], float(sys.argv[2])
t = load(by_name(tname), tname)


class Spy(Policy):
    def __init__(self, inner):
        self.inner = inner
        self.name = "spy"

    def attach(self, sim):
        super().attach(sim)
        self.inner.attach(sim)
        self.last = {}
        self.cnt = collections.Counter()
        self.clock = 0
        self.hist = collections.Counter()
        self.byhits = collections.Counter()

    def hit(self, path):
        s = self.sim
        if s.r >= len(s.trace.reqs) // 2:
            for n in path:
                k = s.key[n]
                age = self.clock - self.last.get(k, 0)
                self.hist[min(age.bit_length(), 20)] += 1
                self.byhits[min(self.cnt[k], 6)] += 1
        for n in path:
            k = s.key[n]
            self.last[k] = self.clock
            self.cnt[k] += 1
        self.inner.hit(path)

    def insert(self, new):
        for n in new:
            k = self.sim.key[n]
            self.last[k] = self.clock
            self.cnt[k] += 1
        self.inner.insert(new)

    def victim(self, p):
        return self.inner.victim(p)

    def leaf(self, n):
        self.inner.leaf(n)

    def end(self):
        self.clock += self.sim.req_blocks
        self.inner.end()


for pn in sys.argv[3:]:
    spy = Spy(make(pn))
    res = Sim(t, cap).run(spy)
    print(pn, "hit %.4f" % res.hit_rate)
    tot = sum(spy.hist.values())
    print("  age log2 (lookups) of hit blocks:", " ".join("%d:%d" % (k, v) for k, v in sorted(spy.hist.items())))
    print("  prior accesses of hit blocks:", " ".join("%d:%d" % (k, v) for k, v in sorted(spy.byhits.items())))
