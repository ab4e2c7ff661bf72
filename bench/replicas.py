"""Part 4b: do two replicas answer alike? A LoCoMo-layout file loaded through a server, then two
indexes of the same store (the server's own and one built from the change log, as another replica's
would be), every question asked of both in every mode.

Qdrant ranks equal scores in no fixed order, so before the keyword weights' tie-break
(memory_server/storage/vectors/sparse.py) 507 of LoCoMo's 1,986 hybrid top 10s came back in another
order from the second index (bench/analysis.md, round 24).
"""

import argparse
import json
import tempfile
from pathlib import Path

import httpx
from sqlmodel import Session, select

from bench import locomo
from bench.server import running_server
from bench.workload import machine, write_result
from memory_server.auth import Principal
from memory_server.config import Settings
from memory_server.models import ApiKey
from memory_server.runtime import Runtime
from memory_server.schemas import SearchRequest


def compare(settings: Settings, samples: list, top_k: int = 10, embedder=None) -> dict:
    """Open two runtimes on a loaded data directory: the first takes the index already there, the
    second builds its own from the change log. Count the questions whose answers differ."""
    first = Runtime.open(settings, embedder=embedder)
    second = None
    try:
        second = Runtime.open(settings, embedder=first.embedder)
        with Session(first.engine) as session:
            tenant = session.exec(select(ApiKey.tenant_id)).first()
        principal = Principal(tenant, "bench-replicas", "admin")
        questions = [(locomo.scope_id(s["sample_id"]), qa["question"]) for s in samples for qa in s["qa"]]

        def ids(runtime, user, question, mode):
            request = SearchRequest(query=question, filters={"user_id": user}, top_k=top_k, mode=mode)
            return [hit.id for hit in runtime.memories.search(principal, request)]

        result = {"questions": len(questions), "top_k": top_k, "points": [first.index.info().points,
                                                                          second.index.info().points], "modes": {}}
        for mode in locomo.MODES:
            counts = dict.fromkeys(("top5_set_differs", "set_differs", "order_differs"), 0)
            for user, question in questions:
                a, b = ids(first, user, question, mode), ids(second, user, question, mode)
                counts["top5_set_differs"] += set(a[:5]) != set(b[:5])
                counts["set_differs"] += set(a) != set(b)
                counts["order_differs"] += a != b
            result["modes"][mode] = counts
        # For reference: one index asked twice.
        result["same_index_twice_order_differs"] = sum(
            ids(first, user, question, "hybrid") != ids(first, user, question, "hybrid") for user, question in questions)
        return result
    finally:
        first.close()
        if second is not None:
            second.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", default="/work/shared/data/locomo/locomo10.json",
                   help="a file in LoCoMo's JSON layout (LoCoMo is CC BY-NC: read it from where it lies)")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--out", default="replicas")
    a = p.parse_args(argv)
    samples = json.loads(Path(a.path).read_text())[:a.limit]
    result = {"machine": machine(), "dataset": Path(a.path).name, "conversations": len(samples)}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as data_dir:
        with running_server(Path(data_dir)) as server, httpx.Client(base_url=server.url, headers=server.headers,
                                                                     timeout=600) as client:
            locomo.load(client, samples)
        # The server has stopped: the first runtime takes its index, the second builds one.
        result.update(compare(Settings(data_dir=Path(data_dir)), samples, a.top_k))
    for mode, counts in result["modes"].items():
        print(f"replicas {mode}: {counts}", flush=True)
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
