"""One vLLM process running a scripted scenario, for ``test_connector.py`` (vLLM spawns
its engine: this runs as ``python scenario.py JOB.json OUT.json``, not under pytest).

The job names the engine (``connector``: prefixcache's tiers, or none; vLLM's own
prefix cache on or off; ``loras``: adapters by name, to serve with ``--enable-lora``;
``engine``: more of vLLM's engine arguments) and its steps: ``generate`` (prompts, as text
or token ids, with their cache salts and adapters, greedy), ``kill`` (SIGKILL a process,
e.g. the Redis under a tier), ``reset`` (vLLM lets its own prefix cache go). The result
has, per generated prompt, its token counts, ``num_cached_tokens``, the output tokens and
their log-probabilities.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def engine(job: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=job.get("prefix_caching", False),
        gpu_memory_utilization=0.3,
        seed=0,
    )
    if job.get("loras"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    kwargs.update(job.get("engine", {}))
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=job["connector"],
        )
    return LLM(**kwargs)


def main(job_path: str, out_path: str) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    with open(job_path) as f:
        job = json.load(f)
    llm = engine(job)
    loras = {
        name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(job.get("loras", {}).items()))
    }
    results: list[dict[str, Any]] = []
    for step in job["steps"]:
        if "kill" in step:
            os.kill(step["kill"], signal.SIGKILL)
            results.append({"killed": step["kill"]})
            continue
        if step.get("reset"):
            results.append({"reset": llm.reset_prefix_cache()})
            continue
        params = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 12), ignore_eos=True, logprobs=1)
        prompts = [
            {
                **({"prompt_token_ids": p["ids"]} if "ids" in p else {"prompt": p["prompt"]}),
                **({"cache_salt": p["salt"]} if p.get("salt") else {}),
            }
            for p in step["generate"]
        ]
        adapters = [loras[p["lora"]] if p.get("lora") else None for p in step["generate"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters if loras else None)
        elapsed = time.perf_counter() - start
        for p, out in zip(step["generate"], outputs, strict=True):
            results.append(
                {
                    "name": p["name"],
                    "prompt_tokens": len(out.prompt_token_ids),
                    "cached": out.num_cached_tokens,
                    "output": list(out.outputs[0].token_ids),
                    "logprobs": [
                        lp[t].logprob
                        for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs or [], strict=False)
                    ],
                    "seconds": elapsed,
                }
            )
    with open(out_path, "w") as f:
        json.dump(results, f)
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
