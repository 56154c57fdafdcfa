"""An agentic (coding-assistant-like) trace generator, for tuning only.

``prefixcache workload`` draws each chat turn's session uniformly at random, so a
session's next turn is memoryless. Agent loops are not: a session sends its next
request after a tool call and a model answer (seconds), re-sending its whole growing
context, while other sessions interleave. The reuse distance of a session's context
is then roughly the traffic of the other sessions during one step: a loop, where LRU
evicts each session just before its next step. This writes such traffic as our
pre-hashed JSONL (``hash_ids``, ``block_size``, ``input_length``):

* sessions arrive as a Poisson process; each runs a geometric number of steps;
* a session starts from one of a few agent system prompts (tools included) shared
  by all its sessions, then its task;
* each step re-sends the context and appends the answer and the tool output;
* the next step follows after a lognormal think time.

All constants are parameters; the defaults are of the order of published Claude Code
traces (contexts of tens of thousands of tokens, steps seconds apart), not fitted.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from pathlib import Path


def generate(
    out: Path,
    requests: int = 6000,
    seed: int = 1,
    block_size: int = 64,
    arrival_s: float = 6.0,  # mean seconds between new sessions
    steps: float = 25.0,  # mean steps per session
    think_s: float = 8.0,  # median seconds between a session's steps
    prompts: int = 4,  # distinct agent system prompts
    prompt_tokens: int = 12_000,
    task_tokens: tuple[int, int] = (200, 3000),
    step_tokens: tuple[int, int] = (100, 2500),  # answer + tool output per step
) -> int:
    rng = random.Random(seed)
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    fresh = [0]

    def new_tokens(n: int) -> list[int]:
        out = list(range(fresh[0], fresh[0] + n))
        fresh[0] += n
        return out

    heads = [new_tokens(prompt_tokens) for _ in range(prompts)]
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = new session / 1 = step, session)
    sessions: dict[int, tuple[list[int], int]] = {}
    t, n_sessions = 0.0, 0
    heapq.heappush(events, (0.0, 0, -1))
    written = 0
    with out.open("w") as f:
        while written < requests and events:
            t, kind, sid = heapq.heappop(events)
            if kind == 0:
                sid = n_sessions
                n_sessions += 1
                head = heads[min(int(rng.expovariate(1.0) * prompts / 2), prompts - 1)]
                sessions[sid] = (head + new_tokens(rng.randint(*task_tokens)), 1 + int(rng.expovariate(1.0 / steps)))
                heapq.heappush(events, (t + rng.expovariate(1.0 / arrival_s), 0, -1))
            context, left = sessions[sid]
            # prefix ids of the context's blocks (the last one partial)
            hash_ids, parent = [], -1
            for start in range(0, len(context), block_size):
                key = (parent, tuple(context[start : start + block_size]))
                parent = ids.setdefault(key, len(ids))
                hash_ids.append(parent)
            rec = {
                "timestamp": round(t, 6),
                "tenant": "t",
                "model": "m",
                "hash_ids": hash_ids,
                "block_size": block_size,
                "input_length": len(context),
                "output_length": 0,
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            written += 1
            if left > 1:
                sessions[sid] = (context + new_tokens(rng.randint(*step_tokens)), left - 1)
                heapq.heappush(events, (t + rng.lognormvariate(0.0, 0.8) * think_s, 1, sid))
            else:
                del sessions[sid]
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    a = ap.parse_args(argv)
    n = generate(a.out, a.requests, a.seed, a.block_size)
    print(f"wrote {n} requests to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
