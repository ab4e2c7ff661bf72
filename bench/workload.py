"""Deterministic synthetic memories and queries shared by both sides of the mem0 comparison.

Standard library only: it is imported from the main venv and from .venv-bench alike.
"""

import json
import math
import platform
import random
import time
from collections.abc import Iterator
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"
USERS = 1000

_NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jia",
          "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
_FACTS = [
    "likes {food} for {meal}",
    "is allergic to {food}",
    "has a {pet} called {petname}",
    "lives in {city} and works as a {job}",
    "moved to {city} in {year}",
    "is learning {skill} on {day}s",
    "prefers {drink} over {drink2}",
    "plans a trip to {city} in {month}",
    "plays {sport} every {day}",
    "is reading a book about {topic}",
    "wants reminders about {topic} meetings on {day}",
    "bought a new {thing} last {month}",
    "has a sister who studies {topic} in {city}",
    "dislikes {food} and avoids {drink}",
    "runs a small {topic} podcast with a friend from {city}",
]
_WORDS = {
    "food": ["sushi", "lasagna", "peanuts", "oatmeal", "tacos", "ramen", "falafel", "curry", "pancakes", "kimchi"],
    "meal": ["breakfast", "lunch", "dinner", "a late snack"],
    "pet": ["dog", "cat", "parrot", "rabbit", "tortoise", "hamster"],
    "petname": ["Rex", "Milo", "Luna", "Pepper", "Biscuit", "Kiwi", "Ziggy"],
    "city": ["Lisbon", "Nairobi", "Osaka", "Toronto", "Berlin", "Lima", "Hanoi", "Oslo", "Austin", "Cairo"],
    "job": ["nurse", "carpenter", "data analyst", "teacher", "pilot", "chef", "lawyer", "designer"],
    "year": [str(y) for y in range(2008, 2025)],
    "skill": ["Spanish", "the piano", "pottery", "Python", "chess", "watercolour painting", "salsa"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "drink": ["green tea", "espresso", "sparkling water", "orange juice", "oat milk lattes"],
    "drink2": ["black coffee", "soda", "herbal tea", "hot chocolate"],
    "month": ["January", "March", "May", "July", "September", "November"],
    "sport": ["tennis", "basketball", "badminton", "football", "squash", "volleyball"],
    "topic": ["astronomy", "ancient Rome", "machine learning", "gardening", "jazz", "climate policy", "cycling"],
    "thing": ["laptop", "bicycle", "camera", "standing desk", "espresso machine", "kayak"],
}
_QUESTIONS = [
    "What does {name} like to eat?",
    "Which pet does {name} have?",
    "Where does {name} live?",
    "What is {name} learning?",
    "What does {name} drink?",
    "Where is {name} travelling?",
    "Which sport does {name} play?",
    "What is {name} reading about?",
    "What did {name} buy recently?",
    "Any allergies I should know about?",
    "job and city",
    "{topic} {day}",
]


def user_id(i: int) -> str:
    return f"user-{i % USERS:04d}"


def _fill(template: str, rng: random.Random) -> str:
    fields = {k: rng.choice(v) for k, v in _WORDS.items()}
    fields["name"] = rng.choice(_NAMES)
    return template.format(**fields)


def memories(n: int, seed: int = 7) -> list[tuple[str, str]]:
    """n (user_id, text) pairs; memory i belongs to user i % 1000, so any prefix spans all users."""
    return list(iter_memories(n, seed))


def iter_memories(n: int, seed: int = 7) -> Iterator[tuple[str, str]]:
    """memories(n, seed), one at a time: a 1M list would be ~230 MB of the measuring process's RSS."""
    rng = random.Random(seed)
    for i in range(n):
        name = rng.choice(_NAMES)
        text = f"{name} {_fill(rng.choice(_FACTS), rng)}."
        if rng.random() < 0.3:
            text += f" Mentioned on a {rng.choice(_WORDS['day'])} call #{i}."
        yield user_id(i), text


def queries(n: int, seed: int = 11) -> list[tuple[str, str]]:
    """n (user_id, query) pairs over all users."""
    rng = random.Random(seed)
    return [(user_id(rng.randrange(USERS)), _fill(rng.choice(_QUESTIONS), rng)) for _ in range(n)]


def percentiles(latencies_s: list[float]) -> dict:
    """p50/p95/p99/mean in milliseconds (nearest-rank)."""
    xs = sorted(latencies_s)
    if not xs:
        return {"n": 0}

    def rank(p):
        return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)] * 1000

    return {"n": len(xs), "p50_ms": rank(50), "p95_ms": rank(95), "p99_ms": rank(99),
            "mean_ms": sum(xs) / len(xs) * 1000}


def machine() -> dict:
    import os
    # The load average at the start tells whether something else was competing for the CPUs; the
    # loop's time whether the box itself ran slow (write_result times it again at the end).
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_1m": os.getloadavg()[0],
            "python_loop_s": python_loop_s(), **_processor()}


def python_loop_s() -> float:
    """Seconds a bare Python loop of 10^7 additions takes, from the best of five runs of 10^6 (~0.5 s;
    it reads ~10% below one run of 10^7 on a quiet box, more on a busy one). The shared
    machines these benchmarks run on have changed speed by 2x within an hour with nothing else running
    (bench/analysis.md, rounds 10 and 11): a result whose loop time moved between its start and its end
    ran on a box that changed under it."""
    # At module level, as `python3 -c` runs it (global variables: the figures in bench/analysis.md);
    # inside a function the same loop takes about a third of the time.
    # The best of five runs of 10^6: a run that another process interrupted does not count.
    took = []
    for _ in range(5):
        started = time.perf_counter()
        exec("s = 0\nfor i in range(1_000_000):\n    s += i", {})
        took.append(time.perf_counter() - started)
    return round(min(took) * 10, 2)


# The model's speed depends most on these: the int8 model ran ~4x faster on a 2-core Zen 5 with
# AVX-512 VNNI than on a 2-core Zen 3 with AVX2 only (bench/analysis.md, round 5).
SIMD = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def _processor() -> dict:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor() or "?"}
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})",
            "simd": [f for f in SIMD if f in flags]}


def write_result(name: str, data: dict) -> Path:
    if "machine" in data:
        data["machine"]["python_loop_s_at_end"] = python_loop_s()
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
