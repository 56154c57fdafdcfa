"""Blended prefill on reordered RAG prompts: prefill time saved against quality.

Four documents are prefilled alone (the chunk store's KV); each prompt puts them in
another order and adds a question. For EPIC's k and CacheBlend's r, against a full
prefill of the same prompt in the same process: the prefill time saved (best of a few
runs each), the share of (token, layer) work done, top-1 next-token agreement, and
exact match of 16 greedy tokens decoded from the blended cache. The curve is printed
whatever it shows.

    .venv/bin/python benchmarks/bench_blend.py [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixcache.blend import (
    CacheBlend,
    Epic,
    Fresh,
    RecomputePlan,
    Reused,
    blend_prefill,
    greedy_continue,
    prefill_chunk,
)
from prefixcache.engine import LoadedModel, load_model
from prefixcache.engine.runner import Sequence

MODELS_DIR = Path(__file__).resolve().parent.parent / ".prefixcache" / "models"
GREEDY = 16

DOCS = (
    "The river Thames rises in the Cotswold hills of Gloucestershire and flows eastwards for about three hundred "
    "and forty kilometres to the North Sea. On its way it passes through Oxford, where it is locally called the "
    "Isis, then Reading, Windsor and finally London, where it becomes a tidal estuary. For centuries the river was "
    "the main road of the city: barges carried coal, timber and grain to the wharves, and the Port of London was "
    "once the busiest in the world. In the nineteenth century the river was so polluted that the summer of 1858 "
    "became known as the Great Stink, which pushed Parliament to fund a new sewer system designed by the engineer "
    "Joseph Bazalgette. Today the Thames Barrier, completed in 1982, protects the capital from storm surges coming "
    "up the estuary, and the river is clean enough for seals and salmon to return.",
    "Mount Fuji is the highest mountain in Japan, rising to three thousand seven hundred and seventy-six metres on "
    "the island of Honshu, about one hundred kilometres south-west of Tokyo. It is an active stratovolcano that "
    "last erupted in 1707, during the Edo period, when the Hoei eruption covered the surrounding towns in ash. Its "
    "almost perfectly symmetrical cone, snow-capped for much of the year, has made it a symbol of the country and "
    "a favourite subject of artists such as Hokusai, whose series of prints called Thirty-six Views of Mount Fuji "
    "is famous around the world. The official climbing season runs from early July to early September, when "
    "mountain huts along the four main trails are open, and many climbers walk through the night to watch the "
    "sunrise from the summit. In 2013 the mountain was added to the list of World Heritage sites as a cultural site.",
    "Honey bees live in colonies that can hold tens of thousands of individuals but only one queen. The queen lays "
    "all the eggs of the colony, up to two thousand a day in summer, while the workers, which are all female, do "
    "every other task: they clean the cells, feed the larvae, build wax comb, guard the entrance and, in the last "
    "weeks of their short lives, fly out to collect nectar, pollen, water and plant resins. A forager that finds "
    "a rich patch of flowers returns to the hive and performs a waggle dance, whose direction and duration tell her "
    "sisters the bearing and the distance of the food. The males, called drones, do not work and exist only to mate "
    "with young queens from other colonies. In winter the bees cluster together and shiver their flight muscles to "
    "keep the centre of the cluster warm, living on the honey they stored during the summer.",
    "Copper is a soft, reddish metal that conducts heat and electricity better than any other metal except silver. "
    "It was one of the first metals used by people, more than ten thousand years ago, and mixing it with tin gave "
    "bronze, the alloy that named an age of human history. Because it is a good conductor and easy to draw into "
    "thin wire, about half of the copper produced today goes into electrical wiring, motors and transformers. It "
    "is also used for water pipes, roofing and cooking pans, and in coins, often as an alloy with nickel or zinc; "
    "brass is an alloy of copper and zinc. When copper is exposed to the air for many years it forms a green layer "
    "called patina, which protects the metal underneath, as can be seen on the Statue of Liberty. Chile is the "
    "largest producer of copper, followed by Peru and the Democratic Republic of the Congo.",
)

PROMPTS = (  # (document order, question)
    ((1, 0, 3, 2), "\nQuestion: which engineer designed the new sewer system of London? Answer:"),
    ((3, 2, 1, 0), "\nQuestion: in which year did Mount Fuji last erupt? Answer:"),
    ((2, 3, 0, 1), "\nQuestion: what do honey bees do in winter to keep warm? Answer:"),
    ((0, 3, 1, 2), "\nQuestion: which metal is mixed with copper to make brass? Answer:"),
)

PLANS: tuple[RecomputePlan, ...] = (
    Epic(0),
    Epic(8),
    Epic(32),
    Epic(96),
    CacheBlend(5.0),
    CacheBlend(15.0),
    CacheBlend(30.0),
    CacheBlend(50.0),
    CacheBlend(100.0),
)


def best_time(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return best, out


def full_prefill(lm: LoadedModel, tokens: list[int]) -> tuple[torch.Tensor, Sequence]:
    seq = Sequence(lm)
    return seq.prefill(tokens)[0], seq


def name(plan: RecomputePlan) -> str:
    return f"EPIC k={plan.k}" if isinstance(plan, Epic) else f"CacheBlend r={plan.r:g}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each prefill (the best counts)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(models_dir=MODELS_DIR, device="cpu")
    docs = [tuple(lm.tokenizer.encode(doc, add_special_tokens=False)) for doc in DOCS]
    chunks = [Reused(doc, prefill_chunk(lm, doc)) for doc in docs]
    print(f"model {Path(lm.source).name}, {lm.kv.layers} layers; documents of {[len(d) for d in docs]} tokens")

    rows: dict[str, list[tuple[float, float, bool, bool]]] = {name(plan): [] for plan in PLANS}
    for order, question in PROMPTS:
        q = tuple(lm.tokenizer.encode(question, add_special_tokens=False))
        segments = [chunks[i] for i in order] + [Fresh(q)]
        tokens = [t for i in order for t in docs[i]] + list(q)
        full_s, (logits, seq) = best_time(lambda tokens=tokens: full_prefill(lm, tokens), args.repeats)
        want_top = int(logits.argmax())
        want_text = greedy_continue(lm, seq.cache, logits, GREEDY)
        print(f"prompt of {len(tokens)} tokens, full prefill {full_s * 1000:.0f} ms")
        for plan in PLANS:
            run = functools.partial(blend_prefill, lm, segments, plan)
            blend_s, result = best_time(run, args.repeats)
            text = greedy_continue(lm, result.cache, result.logits, GREEDY)
            work = result.token_layers / (len(tokens) * lm.kv.layers)
            rows[name(plan)].append(
                (1.0 - blend_s / full_s, work, int(result.logits.argmax()) == want_top, text == want_text)
            )

    print(f"\n{len(PROMPTS)} reordered-RAG prompts; time saved = 1 - blended / full prefill (best of {args.repeats})")
    print(f"{'plan':<22}{'time saved':>12}{'work done':>11}{'top-1 agree':>13}{f'greedy-{GREEDY} EM':>14}")
    for label, results in rows.items():
        n = len(results)
        saved = sum(r[0] for r in results) / n
        work = sum(r[1] for r in results) / n
        top1 = sum(r[2] for r in results) / n
        exact = sum(r[3] for r in results) / n
        print(f"{label:<22}{saved:>11.0%}{work:>11.0%}{top1:>13.0%}{exact:>14.0%}")


if __name__ == "__main__":
    main()
