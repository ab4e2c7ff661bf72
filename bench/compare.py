"""Part 1 driver: the same adds and searches against one side (ours or mem0), in this process.

A side is an object with add_one(user, text), add_groups([(user, [texts])]), fill([(user, text)])
and search(user, query, mode) plus a list `modes`. Standard library + tqdm only, so that it runs
in the main venv and in .venv-bench.
"""

import time

from tqdm import tqdm

from bench.workload import machine, memories, percentiles, queries


def _by_user(items):
    """[(user, [indices into items])] in order of first appearance."""
    groups = {}
    for i, (user, _) in enumerate(items):
        groups.setdefault(user, []).append(i)
    return list(groups.items())


def measure(side, name, sizes=(1000, 10000, 100000), batch_groups=100, n_queries=300, warmup=20,
            max_seconds=120.0):
    """Adds, then per size: fill up to it and time searches (n_queries, or fewer past max_seconds)."""
    sizes = sorted(sizes)
    largest = max(sizes)
    data = memories(largest + AFTER)
    qs = queries(n_queries + warmup)
    out = {"side": name, "machine": machine(), "sizes": sizes, "search": {}, "fill": []}
    out.update(getattr(side, "describe", dict)())

    # One at a time: the first size (1k memories = one per user).
    lat = []
    t0 = time.perf_counter()
    for user, text in tqdm(data[: sizes[0]], desc=f"{name}: add one at a time", unit="mem"):
        t = time.perf_counter()
        side.add_one(user, text)
        lat.append(time.perf_counter() - t)
    took = time.perf_counter() - t0
    out["add_single"] = {"n": len(lat), "seconds": took, "per_s": len(lat) / took, **percentiles(lat)}
    filled = sizes[0]

    for size in sizes:
        if filled < size:
            chunk = data[filled:size]
            if "add_batched" not in out:
                # Batched: the first `batch_groups` users' memories of this slice, one call per user for
                # mem0 (its add() takes one scope), as few calls as the API allows for ours.
                groups = _by_user(chunk)[:batch_groups]
                done = {i for _, idx in groups for i in idx}
                t0 = time.perf_counter()
                calls = side.add_groups([(u, [chunk[i][1] for i in idx]) for u, idx in groups])
                took = time.perf_counter() - t0
                out["add_batched"] = {"n": len(done), "calls": calls, "seconds": took, "per_s": len(done) / took}
                chunk = [item for i, item in enumerate(chunk) if i not in done]
            t0 = time.perf_counter()
            side.fill(chunk)
            took = time.perf_counter() - t0
            out["fill"].append({"to": size, "n": len(chunk), "seconds": took, "per_s": len(chunk) / took})
            filled = size
        out["search"][str(size)] = {}
        for mode in side.modes:
            for user, query in qs[:warmup]:
                side.search(user, query, mode)
            lat = []
            hits = 0
            deadline = time.perf_counter() + max_seconds
            for user, query in tqdm(qs[warmup:], desc=f"{name}: search {size} {mode}", unit="q"):
                t = time.perf_counter()
                hits += side.search(user, query, mode)
                lat.append(time.perf_counter() - t)
                if t > deadline and len(lat) >= 50:
                    break
            out["search"][str(size)][mode] = {**percentiles(lat), "mean_results": hits / len(lat)}
    out["add_at_largest"] = _adds_at(side, name, data[largest:], largest, batch_groups)
    return out


AFTER = 12000  # memories past the largest size, for the adds timed there


def _adds_at(side, name, fresh, size, batch_groups, singles=300):
    """The same two kinds of add, into the store at its largest size (the target compares add
    throughput at 100k memories): `singles` one at a time, then `batch_groups` users' memories."""
    lat = []
    t0 = time.perf_counter()
    for user, text in tqdm(fresh[:singles], desc=f"{name}: add one at a time at {size}", unit="mem"):
        t = time.perf_counter()
        side.add_one(user, text)
        lat.append(time.perf_counter() - t)
    single = {"n": len(lat), "seconds": time.perf_counter() - t0, **percentiles(lat)}
    single["per_s"] = single["n"] / single["seconds"]
    chunk = fresh[singles:]
    groups = _by_user(chunk)[:batch_groups]
    t0 = time.perf_counter()
    calls = side.add_groups([(u, [chunk[i][1] for i in idx]) for u, idx in groups])
    took = time.perf_counter() - t0
    n = sum(len(idx) for _, idx in groups)
    return {"size": size, "add_single": single, "add_batched": {"n": n, "calls": calls, "seconds": took, "per_s": n / took}}
