"""Pre-hashed traces as the research harness replays them.

Two formats, both pre-hashed (prefix block ids):

* Mooncake FAST'25 (``hash_ids`` of 512-token blocks, no ``block_size`` field);
* our JSONL with ``hash_ids``, ``block_size`` and ``input_length`` (what
  ``prefixcache workload --emit hash_ids`` writes).

Each request becomes ``Req(t, input_length, ids, root)``: ``root`` names the
context (the model; shared isolation, as the replay's default), so two models never
share a block, exactly as the replay's tree does.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TRACES = REPO / "tests" / "data" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"
WORK = Path("/tmp/eviction-research")  # generated workloads (reproducible from their spec)


@dataclass(frozen=True, slots=True)
class Req:
    t: float  # seconds
    input_length: int
    ids: tuple[int, ...]
    root: str


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_size: int
    reqs: list[Req]

    @property
    def blocks(self) -> int:
        return sum(len(r.ids) for r in self.reqs)

    @property
    def unique_blocks(self) -> int:
        return len({(r.root, i) for r in self.reqs for i in r.ids})


def load(path: str | Path, name: str | None = None) -> Trace:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    reqs: list[Req] = []
    block_size = 0
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "block_size" in rec:  # ours
                bs, t, root = int(rec["block_size"]), float(rec["timestamp"]), str(rec["model"])
            else:  # Mooncake: milliseconds, 512-token blocks, one model
                bs, t, root = 512, rec["timestamp"] / 1000.0, ""
            if block_size and bs != block_size:
                raise ValueError(f"{path}: mixed block sizes {block_size} and {bs}")
            block_size = bs
            reqs.append(Req(t, int(rec["input_length"]), tuple(rec["hash_ids"]), root))
    return Trace(name or path.stem, block_size, reqs)


# ---------------------------------------------------------------------------- generated workloads

# NOTE: the tuning set's generated workloads, by name: ``prefixcache workload`` arguments.
# They differ in what dominates (long-lived chats vs short sessions, agents with long
# tool prompts, one-off scans) and in block size (16 as vLLM/SGLang, 64 as the agentic
# traces of the published curves).
WORKLOADS: dict[str, list[str]] = {
    "gen-default-b16": ["--requests", "6000", "--tenants", "16", "--seed", "1", "--block-size", "16"],
    "gen-turns4-b64": [
        "--requests",
        "6000",
        "--tenants",
        "32",
        "--seed",
        "2",
        "--block-size",
        "64",
        "--max-turns",
        "4",
    ],
    "gen-turns12-b32": [
        "--requests",
        "6000",
        "--tenants",
        "8",
        "--seed",
        "3",
        "--block-size",
        "32",
        "--max-turns",
        "12",
    ],
}


# NOTE: agent loops (research/eviction/agentic.py, our own generator: each session
# re-sends its growing context every few seconds), by name: (requests, seed, block size).
AGENTIC: dict[str, tuple[int, int, int]] = {"agentic-b64": (3000, 1, 64)}


def workload(name: str) -> Path:
    """The generated workload ``name``, written once to WORK."""
    WORK.mkdir(parents=True, exist_ok=True)
    out = WORK / f"{name}.jsonl"
    if name in AGENTIC and not out.exists():
        from research.eviction.agentic import generate

        requests, seed, block_size = AGENTIC[name]
        generate(out, requests, seed, block_size)
    if not out.exists():
        cli = Path(sys.executable).parent / "prefixcache"
        subprocess.run([str(cli), "workload", str(out), "--emit", "hash_ids", *WORKLOADS[name]], check=True)
    return out


def by_name(name: str) -> Path:
    if name == "conversation":
        return CONVERSATION
    if name == "synthetic":
        return SYNTHETIC
    if name in WORKLOADS or name in AGENTIC:
        return workload(name)
    return Path(name)
