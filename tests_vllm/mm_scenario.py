"""One vLLM process serving the tiny Idefics3 model (``tiny_mm.py``), for
``test_multimodal.py``: ``python mm_scenario.py JOB.json OUT.json``, like ``scenario.py``
but each prompt carries an image.

The job names the model folder, the connector (prefixcache's tiers, or none) and its
steps, each a list of prompts ``{"name", "prompt", "image"}`` and optionally ``"uuid"``
(vLLM's ``multi_modal_uuids``: the client names the image); an image is named, not
sent: ``black``, ``white`` or ``noise:SEED`` (made here, the same in every process).
The result has, per prompt, its token count, the offset and length of its image's
placeholder tokens, ``num_cached_tokens`` and the output tokens.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tiny_mm import IMAGE_SIZE


def image(name: str) -> Any:
    import numpy as np
    from PIL import Image

    if name in ("black", "white"):
        return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), name)
    kind, _, seed = name.partition(":")
    if kind != "noise" or not seed.isdigit():
        raise ValueError(f"unknown image {name!r}: black, white or noise:SEED")
    pixels = np.random.default_rng(int(seed)).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def engine(job: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
        seed=0,
        limit_mm_per_prompt={"image": 1},
    )
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=job["connector"],
        )
    return LLM(**kwargs)


def placeholder(token_ids: list[int], token_id: int) -> tuple[int, int]:
    """The offset and length of the run of ``token_id`` in ``token_ids``."""
    positions = [i for i, t in enumerate(token_ids) if t == token_id]
    if not positions or positions[-1] - positions[0] + 1 != len(positions):
        raise ValueError(f"expected one run of image tokens, got positions {positions}")
    return positions[0], len(positions)


def main(job_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    llm = engine(job)
    image_token = llm.llm_engine.model_config.hf_config.image_token_id
    results: list[dict[str, Any]] = []
    for step in job["steps"]:
        params = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 12), ignore_eos=True)
        prompts = [
            {
                "prompt": p["prompt"],
                "multi_modal_data": {"image": image(p["image"])},
                **({"multi_modal_uuids": {"image": [p["uuid"]]}} if p.get("uuid") else {}),
            }
            for p in step["generate"]
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for p, out in zip(step["generate"], outputs, strict=True):
            offset, length = placeholder(list(out.prompt_token_ids), image_token)
            results.append(
                {
                    "name": p["name"],
                    "prompt_tokens": len(out.prompt_token_ids),
                    "image_offset": offset,
                    "image_length": length,
                    "cached": out.num_cached_tokens,
                    "output": list(out.outputs[0].token_ids),
                }
            )
    with open(out_path, "w") as f:
        json.dump(results, f)
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
