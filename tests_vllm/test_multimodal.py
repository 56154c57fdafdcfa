"""prefixcache inside real vLLM with images (design invariant 12: keys cover every input
that changes the KV): one prompt, two images, connector on equals connector off.

The model is a tiny Idefics3 with random weights, built here (``tiny_mm.py``): a
random vision tower still makes a black and a white image give different answers.
Two vLLM processes run ``mm_scenario.py``, vLLM's own prefix cache off in both: vLLM
alone (the reference), and vLLM with the connector over memory + disk, which is sent
the same text with image A, then image B, then A and B again. B shares A's tokens
(the placeholders are the same ids) but must get from the cache only the whole blocks
before the image's block, never one from the image on.

    blocks:  | 0 text | 1 text | 2 text, image | 3 text | tail |
    B after A: 0..1 cached, 2.. computed;  A after A: 0..3 cached
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from test_connector import run as run_scenario
from tiny_mm import build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEXT_MODEL = Path(
    os.environ.get("PREFIXCACHE_VLLM_MODEL", str(ROOT / ".prefixcache/models/SmolLM2-135M-Instruct.Q4_1"))
)
BLOCK = 128  # vLLM's block size on CPU
A, B = "black", "white"

PASSAGE = (
    "The lighthouse keeper wrote in the log every evening: the wind, the height of the waves, the ships that "
    "passed and the ones that did not. {topic} In winter the lamp burned for sixteen hours, and the keeper "
    "counted the oil by the cup, because the supply boat came only when the sea allowed it. "
)
BEFORE = "".join(PASSAGE.format(topic=f"Gulls {i}.") for i in range(5))
AFTER = "".join(PASSAGE.format(topic=f"Fog {i}.") for i in range(4))
PROMPT = BEFORE + "<image>\n" + AFTER + "\nQuestion: What is in the picture?\nAnswer:"


def gen(*named: tuple[str, str]) -> dict[str, Any]:
    """One step: the prompt with each image, the result named ``name``."""
    return {"generate": [{"name": name, "prompt": PROMPT, "image": image} for name, image in named]}


def run(tmp: Path, name: str, job: dict[str, Any]) -> list[dict[str, Any]]:
    return run_scenario(tmp, name, job, "mm_scenario.py")


def tiers(disk: Path) -> dict[str, Any]:
    return {
        "cache": {
            "tiers": [
                {"kind": "memory", "capacity_bytes": 1 << 28, "write": "through"},
                {"kind": "disk", "capacity_bytes": 1 << 30, "path": str(disk), "write": "through"},
            ]
        }
    }


def full(result: dict[str, Any]) -> int:
    """The whole blocks of the prompt the connector can serve (the last token is always computed)."""
    return (result["prompt_tokens"] - 1) // BLOCK * BLOCK


def before_image(result: dict[str, Any]) -> int:
    """The whole blocks before the block the image's placeholder starts in."""
    return result["image_offset"] // BLOCK * BLOCK


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not Path(TEXT_MODEL, "config.json").is_file():
        pytest.fail(f"no converted model at {TEXT_MODEL} (make test converts it first)")
    tmp = tmp_path_factory.mktemp("vllm-mm")
    model = str(build(tmp / "model", TEXT_MODEL))
    reference = run(tmp, "reference", {"model": model, "connector": None, "steps": [gen(("A", A), ("B", B))]})
    connector = run(
        tmp,
        "connector",
        {
            "model": model,
            "connector": tiers(tmp / "disk"),
            "steps": [gen(("A", A)), gen(("B", B)), gen(("A", A)), gen(("B", B))],
        },
    )
    return {"reference": {r["name"]: r for r in reference}, "connector": connector}


def test_the_image_changes_the_answer(runs: dict[str, Any]) -> None:
    a, b = runs["reference"]["A"], runs["reference"]["B"]
    assert a["output"] != b["output"]
    assert a["cached"] == b["cached"] == 0
    # the same token ids but for the image: only the image tells the two prompts apart
    assert (a["prompt_tokens"], a["image_offset"], a["image_length"]) == (
        b["prompt_tokens"],
        b["image_offset"],
        b["image_length"],
    )
    # the layout the cached counts below rely on: blocks before the image, and after it
    assert BLOCK <= before_image(a) < full(a) - BLOCK
    # the placeholder's text tokens (2 before the image tokens) start in the same block
    assert (a["image_offset"] - 2) // BLOCK == a["image_offset"] // BLOCK


def test_outputs_with_the_connector_equal_vllm_alone(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    for result in runs["connector"]:
        assert result["output"] == reference[result["name"]]["output"], result["name"]


def test_another_image_gets_only_the_blocks_before_it(runs: dict[str, Any]) -> None:
    first_a, b = runs["connector"][:2]
    assert (first_a["name"], first_a["cached"]) == ("A", 0)
    assert b["name"] == "B"
    assert b["cached"] == before_image(b) > 0


def test_the_same_image_again_hits_every_whole_block(runs: dict[str, Any]) -> None:
    again_a, again_b = runs["connector"][2:]
    assert again_a["name"] == "A" and again_a["cached"] == full(again_a)
    assert again_b["name"] == "B" and again_b["cached"] == full(again_b)
