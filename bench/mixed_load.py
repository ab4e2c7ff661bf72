"""Part 2b: in-process concurrent load with texts of different lengths: threads searching with short
queries beside threads adding long messages one at a time, for a fixed duration.

This is what an agent server sees: short search queries (~10 tokens) arriving while the turns of a
conversation (~75 tokens and more) are written back. The embedding micro-batcher puts concurrent
texts into shared model calls; this part measures what that costs when their lengths differ.
"""

import argparse
import random
import threading
import time

from bench.service_side import ServiceSide, temporary_side
from bench.workload import machine, memories, percentiles, queries, write_result

# One ~75-token conversation turn, made unique per add by its note number (else the adds are NOOPs).
LONG_TURN = ("I finally went to that pottery class on Saturday, the one my sister kept telling me about, and "
             "honestly it was harder than it looks: the clay kept collapsing, but the teacher was patient and by "
             "the end I had a lopsided little bowl that I am weirdly proud of. Next week we start glazing")


def run(side: ServiceSide, searchers: int, adders: int, seconds: float) -> dict:
    from memory_server.schemas import AddRequest

    qs = queries(3000, seed=3)
    lat: dict[str, list[float]] = {"search": [], "add": []}
    stop = time.perf_counter() + seconds

    def search(seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < stop:
            user, query = rng.choice(qs)
            started = time.perf_counter()
            side.search(user, query, "hybrid")
            lat["search"].append(time.perf_counter() - started)

    def add(seed: int) -> None:
        rng, n = random.Random(seed), 0
        while time.perf_counter() < stop:
            n += 1
            request = AddRequest(text=f"{LONG_TURN} (note {seed}-{n})", user_id=f"user-{rng.randrange(1000):04d}")
            started = time.perf_counter()
            side.rt.memories.add(side.principal, request)
            lat["add"].append(time.perf_counter() - started)

    threads = ([threading.Thread(target=search, args=(s,)) for s in range(searchers)]
               + [threading.Thread(target=add, args=(1000 + s,)) for s in range(adders)])
    cpu, wall = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done = len(lat["search"]) + len(lat["add"])
    return {"searchers": searchers, "adders": adders, "seconds": wall,
            "searches_per_s": len(lat["search"]) / wall, "adds_per_s": len(lat["add"]) / wall,
            "cpu_ms_per_operation": 1000 * cpu / done if done else None,
            "search": percentiles(lat["search"]), "add": percentiles(lat["add"])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=10000)
    p.add_argument("--searchers", type=int, default=6)
    p.add_argument("--adders", type=int, default=2)
    p.add_argument("--duration", type=float, default=30.0, help="seconds")
    p.add_argument("--out", default="mixed-load")
    a = p.parse_args(argv)
    with temporary_side("bench-mixed-") as side:
        side.fill(memories(a.prefill))
        run(side, 2, 1, min(3.0, a.duration))  # warm-up, not reported
        texts = {"query_tokens": "~11", "added_turn_tokens": "~75"}
        result = {"machine": machine(), "prefill": a.prefill, "texts": texts,
                  **run(side, a.searchers, a.adders, a.duration)}
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
