"""Part 4: retrieval quality on LoCoMo through the server's own search API (dense, keyword, hybrid).

Each conversation is one scope (user_id from its sample_id), each dialogue turn one memory, each
question one search; recall@k = share of a question's evidence turns among the top k (1 when a
question has no evidence). Evidence ids are normalised ("D:11:26" -> "D11:26", "D30:05" -> "D30:5",
"D8:6; D9:17" -> two ids); ids that name no turn stay in the denominator (they cannot be found).
"""

import argparse
import json
import re
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.server import running_server
from bench.workload import machine, write_result

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
KS = (1, 5, 10, 25)
MODES = ("dense", "keyword", "hybrid")
ANCHORS = {"BM25 (LoCoMo paper)": 0.460, "MiniLM dense (LoCoMo paper)": 0.380, "DRAGON (LoCoMo paper)": 0.567}


def scope_id(sample_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._:@-]", "-", str(sample_id))[:128]


def turns(sample: dict):
    """(dia_id, text, session, date) for every turn, sessions in order."""
    conv = sample["conversation"]
    sessions = sorted((int(m.group(1)), k) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
    for n, key in sessions:
        date = conv.get(f"{key}_date_time")
        for turn in conv[key]:
            text = f'{turn["speaker"]} said, "{turn["text"]}"'
            if turn.get("blip_caption"):
                text += f' and shared {turn["blip_caption"]}'
            yield turn["dia_id"], text, n, date


def evidence_ids(evidence) -> list[str]:
    ids = []
    for item in evidence or []:
        for m in re.finditer(r"D:?(\d+):0*(\d+)", str(item)):
            ids.append(f"D{m.group(1)}:{m.group(2)}")
    return ids


def load(client: httpx.Client, samples: list) -> dict:
    """Add every turn, one add per session with its turns as `messages` (each message becomes one
    memory, embedded after the turns before it); returns {memory id: {dia_ids}} (a NOOP'd
    near-duplicate maps to the kept memory)."""
    dia_ids = {}
    stats = {"turns": 0, "events": {}}
    for sample in tqdm(samples, desc="locomo: load conversations", unit="conv"):
        user = scope_id(sample["sample_id"])
        sessions: dict[int, dict] = {}
        for dia, text, n, date in turns(sample):
            item = sessions.setdefault(n, {"messages": [], "user_id": user, "infer": False,
                                           "metadata": {"session": n, "date": date}})
            item["messages"].append({"role": "user", "content": text, "metadata": {"dia_id": dia}})
        batch, size = [], 0
        for item in list(sessions.values()) + [None]:
            if item is None or size + len(item["messages"]) > 1000:
                r = client.post("/v1/memories/batch", json={"items": batch})
                r.raise_for_status()
                sent = [m["metadata"]["dia_id"] for it in batch for m in it["messages"]]
                for dia, res in zip(sent, r.json()["results"], strict=True):
                    dia_ids.setdefault(res["id"], set()).add(dia)
                    stats["events"][res["event"]] = stats["events"].get(res["event"], 0) + 1
                stats["turns"] += len(sent)
                batch, size = [], 0
            if item is not None:
                batch.append(item)
                size += len(item["messages"])
    return dia_ids, stats


def evaluate(client: httpx.Client, samples: list, dia_ids: dict, mode: str) -> dict:
    sums = {}  # category -> [n, recall@k...]
    questions = [(scope_id(s["sample_id"]), qa) for s in samples for qa in s["qa"]]
    for user, qa in tqdm(questions, desc=f"locomo: search {mode}", unit="q"):
        r = client.post("/v1/memories/search",
                        json={"query": qa["question"], "filters": {"user_id": user}, "top_k": max(KS), "mode": mode})
        r.raise_for_status()
        found = []
        for hit in r.json()["results"]:
            found.append(dia_ids.get(hit["id"]) or {(hit.get("metadata") or {}).get("dia_id")})
        gold = set(evidence_ids(qa.get("evidence")))
        row = sums.setdefault(qa.get("category"), [0] + [0.0] * len(KS))
        row[0] += 1
        for j, k in enumerate(KS):
            got = set().union(*found[:k]) if found[:k] else set()
            row[j + 1] += len(gold & got) / len(gold) if gold else 1.0

    def summary(n, *totals):
        return {"n": n, **{f"recall@{k}": t / n for k, t in zip(KS, totals)}}

    out = {CATEGORIES.get(c, str(c)): summary(*row) for c, row in sorted(sums.items(), key=lambda x: str(x[0]))}
    total = [sum(col) for col in zip(*sums.values())]
    out["overall"] = summary(*total)
    return out


def run(client: httpx.Client, path: Path, limit: int | None = None) -> dict:
    samples = json.loads(path.read_text())[:limit]
    dia_ids, stats = load(client, samples)
    result = {"machine": machine(), "dataset": path.name, "conversations": len(samples),
              "questions": sum(len(s["qa"]) for s in samples), "load": stats, "anchors_recall@5": ANCHORS,
              "modes": {}}
    for mode in MODES:
        result["modes"][mode] = evaluate(client, samples, dia_ids, mode)
        o = result["modes"][mode]["overall"]
        print(f"locomo {mode}: " + "  ".join(f"R@{k} {o[f'recall@{k}']:.3f}" for k in KS), flush=True)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", default="/work/shared/data/locomo/locomo10.json",
                   help="a file in LoCoMo's JSON layout (not shipped: CC BY-NC)")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--url", help="use a running server instead of starting one (needs --key)")
    p.add_argument("--key")
    p.add_argument("--out", default="locomo")
    a = p.parse_args(argv)
    if a.url:
        with httpx.Client(base_url=a.url, headers={"Authorization": f"Bearer {a.key}"}, timeout=300) as client:
            result = run(client, Path(a.path), a.limit)
    else:
        with running_server() as server, \
                httpx.Client(base_url=server.url, headers=server.headers, timeout=300) as client:
            result = run(client, Path(a.path), a.limit)
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
