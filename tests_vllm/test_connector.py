"""prefixcache inside real vLLM (CPU, SmolLM2-135M, float32), run from ``.venv-vllm``.

Three vLLM processes, each running ``scenario.py``: vLLM alone (the reference outputs),
vLLM with the connector over memory + disk, and a second vLLM process over the same
disk plus a Redis that is killed mid-run. vLLM's own prefix cache is off in all three,
so every cached token a request reports came from prefixcache. All three serve two
random LoRA adapters made with ``peft`` (``--enable-lora``): each adapter's prompt must
get its own KV, never the other's or the base model's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = os.environ.get("PREFIXCACHE_VLLM_MODEL", str(ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"))
BLOCK = 128  # vLLM's block size on CPU

PASSAGE = (
    "The lighthouse keeper wrote in the log every evening: the wind, the height of the waves, the ships that "
    "passed and the ones that did not. {topic} In winter the lamp burned for sixteen hours, and the keeper "
    "counted the oil by the cup, because the supply boat came only when the sea allowed it. "
)


def prompt(topic: str, repeats: int, question: str) -> str:
    return "".join(PASSAGE.format(topic=f"{topic} {i}.") for i in range(repeats)) + f"\nQuestion: {question}\nAnswer:"


LORA_PROMPTS = [("p1", "erin", "a"), ("p1", "erin", "b")]  # one tenant, one prompt, two adapters
PROMPTS = {
    "p1": prompt("Gulls", 8, "What did the keeper count?"),
    "p2": prompt("Fog", 6, "How long did the lamp burn?"),
    "p3": prompt("Storms", 7, "Who brought the oil?"),
    "p4": prompt("Seals", 5, "What was in the log?"),
    "p5": prompt("Ice", 10, "When did the boat come?"),
    "p6": prompt("Stars", 6, "What did the keeper see?"),
}


def gen(*pairs: tuple[str, str | None] | tuple[str, str | None, str]) -> dict[str, Any]:
    """Prompts by name, with a cache salt and optionally an adapter (the result's name is then ``name@adapter``)."""
    listed = []
    for name, salt, *lora in pairs:
        item = {"name": f"{name}@{lora[0]}" if lora else name, "prompt": PROMPTS[name], "salt": salt}
        listed.append({**item, "lora": lora[0]} if lora else item)
    return {"generate": listed}


def make_adapter(folder: Path, seed: int) -> str:
    """A random rank-8 LoRA adapter of the model (``peft``; both matrices random, so it
    changes the answers)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(folder))
    return str(folder)


def run(tmp: Path, name: str, job: dict[str, Any], script: str = "scenario.py") -> list[dict[str, Any]]:
    """Run ``job`` (SmolLM2 unless it names a model) in a vLLM process of ``script``."""
    job_path, out_path = tmp / f"{name}.json", tmp / f"{name}-out.json"
    job_path.write_text(json.dumps({"model": MODEL, **job}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / script), str(job_path), str(out_path)],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_path.read_text())


def tiers(disk: Path, redis_url: str | None = None) -> dict[str, Any]:
    listed: list[dict[str, Any]] = [
        {"kind": "memory", "capacity_bytes": 1 << 30, "write": "through"},
        {"kind": "disk", "capacity_bytes": 4 << 30, "path": str(disk), "write": "through"},
    ]
    if redis_url:
        listed.append({"kind": "redis", "capacity_bytes": 1 << 30, "url": redis_url})
    return {"cache": {"tiers": listed}}


def full(name: str, results: dict[str, Any]) -> int:
    return (results["prompt_tokens"] - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not Path(MODEL, "config.json").is_file():
        pytest.fail(f"no converted model at {MODEL} (make test converts it first)")
    tmp = tmp_path_factory.mktemp("vllm")
    disk = tmp / "disk"
    loras = {"a": make_adapter(tmp / "lora-a", 1), "b": make_adapter(tmp / "lora-b", 2)}
    baseline = run(
        tmp,
        "baseline",
        {"connector": None, "loras": loras, "steps": [gen(*((n, None) for n in PROMPTS)), gen(*LORA_PROMPTS)]},
    )
    first = run(
        tmp,
        "first",
        {
            "connector": tiers(disk),
            "loras": loras,
            "steps": [
                gen(("p1", "alice")),
                gen(("p1", "alice")),
                gen(("p1", "bob")),
                gen(("p2", "alice"), ("p3", "bob"), ("p4", None)),
                gen(LORA_PROMPTS[0]),
                gen(LORA_PROMPTS[1]),
                gen(("p1", "erin")),  # the base model after both adapters
                gen(LORA_PROMPTS[0]),
                gen(("p5", "carol")),  # last: its blocks are the newest files on disk
            ],
        },
    )
    # the second process finds p5's blocks on disk with its second block corrupted: the newest
    # files are p5's chain, written root first by the background writer
    chain = sorted((disk / "blocks").rglob("*.blk"), key=lambda p: p.stat().st_mtime_ns)[
        -(full("p5", first[-1]) // BLOCK) :
    ]
    data = bytearray(chain[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chain[1].write_bytes(bytes(data))
    (tmp / "redis").mkdir()
    redis = RedisServer(tmp / "redis").start()
    assert redis.proc is not None
    try:
        second = run(
            tmp,
            "second",
            {
                "connector": tiers(disk, redis.url),
                "loras": loras,
                "steps": [
                    gen(("p1", "alice")),
                    gen(("p5", "carol")),
                    gen(("p2", "alice")),
                    {"kill": redis.proc.pid},
                    gen(("p3", "bob"), ("p6", "dave")),
                    gen(("p6", "dave")),
                    gen(LORA_PROMPTS[1]),
                    gen(("p5", "carol")),  # its recomputed blocks were saved again
                ],
            },
        )
    finally:
        redis.stop()
    return {
        "baseline": {r["name"]: r for r in baseline},
        "first": first,
        "second": [r for r in second if "name" in r],
        "tmp": tmp,
    }


def test_greedy_outputs_are_the_same_with_and_without_the_connector(runs: dict[str, Any]) -> None:
    reference = runs["baseline"]
    for result in runs["first"] + runs["second"]:
        assert result["output"] == reference[result["name"]]["output"], result["name"]
    assert all(r["cached"] == 0 for r in reference.values())


def test_a_repeated_prompt_is_served_by_prefixcache_with_vllms_prefix_cache_off(runs: dict[str, Any]) -> None:
    first, again = runs["first"][0], runs["first"][1]
    assert first["cached"] == 0
    assert again["cached"] == full("p1", again) > 0


def test_another_tenant_never_receives_the_blocks(runs: dict[str, Any]) -> None:
    bob = runs["first"][2]
    assert bob["name"] == "p1" and bob["cached"] == 0
    batch = {r["name"]: r for r in runs["first"][3:6]}
    assert batch["p3"]["cached"] == 0 and batch["p4"]["cached"] == 0  # never seen by these tenants


def test_a_second_vllm_process_hits_on_the_first_ones_prompts(runs: dict[str, Any]) -> None:
    p1 = runs["second"][0]
    assert p1["cached"] == full("p1", p1)
    p2 = runs["second"][2]
    assert p2["cached"] == full("p2", p2)


def test_a_corrupted_block_gives_a_shorter_hit_never_a_wrong_token(runs: dict[str, Any]) -> None:
    """The scheduler was told of p5's whole chain (its files are there); the worker
    loaded the first block, found the second corrupt, and vLLM recomputed the rest: the
    request is told of the one block really loaded, and the recomputed blocks are saved
    again (the next request for p5 hits them all)."""
    p5, again = runs["second"][1], runs["second"][-1]
    assert p5["name"] == "p5" and p5["output"] == runs["baseline"]["p5"]["output"]
    log = (runs["tmp"] / "second.log").read_text()
    recomputed = re.findall(
        r"Recovered from KV load failure: 1 request\(s\) rescheduled \((\d+) tokens affected\)", log
    )
    assert recomputed == [str(full("p5", p5) - BLOCK)]
    assert p5["cached"] == BLOCK
    assert again["name"] == "p5" and again["cached"] == full("p5", again)
    assert again["output"] == runs["baseline"]["p5"]["output"]


def test_vllm_keeps_answering_after_redis_is_killed(runs: dict[str, Any]) -> None:
    after = runs["second"][3:6]
    assert [r["name"] for r in after] == ["p3", "p6", "p6"]
    assert after[2]["cached"] == full("p6", after[2])  # still cached, in memory and on disk


def test_each_lora_adapter_gets_its_own_kv_never_another_adapters(runs: dict[str, Any]) -> None:
    """One tenant sends one prompt to adapter a, adapter b and the base model: each is
    computed (0 cached), each answer equals vLLM's alone, the adapters answer differently
    from each other and from the base model; a repeat of a hits its own blocks, and
    after a restart b's blocks come back from disk for b."""
    reference = runs["baseline"]
    assert len({tuple(reference[n]["output"]) for n in ("p1", "p1@a", "p1@b")}) == 3  # the adapters matter
    a, b, base, again = runs["first"][-5:-1]
    assert [r["name"] for r in (a, b, base, again)] == ["p1@a", "p1@b", "p1", "p1@a"]
    assert a["cached"] == b["cached"] == base["cached"] == 0
    assert again["cached"] == full("p1", again)
    restarted = runs["second"][-2]
    assert restarted["name"] == "p1@b" and restarted["cached"] == full("p1", restarted)
    for result in (a, b, base, again, restarted):
        assert result["output"] == reference[result["name"]]["output"], result["name"]
