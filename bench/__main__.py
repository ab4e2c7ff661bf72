"""`python -m bench [mem0|service|latency|mixed|http|locomo|replicas|report]`: run one part, or with no part all of
them + the report (`replicas` only when asked)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEM0_PYTHON = os.environ.get("BENCH_MEM0_PYTHON", str(ROOT / ".venv-bench" / "bin" / "python"))
LOCOMO = os.environ.get("BENCH_LOCOMO", "/work/shared/data/locomo/locomo10.json")
QUICK = {"mem0": ["--sizes", "1000,3000", "--queries", "50", "--batch-groups", "20", "--out", "quick-mem0"],
         "service": ["--sizes", "1000,3000", "--queries", "50", "--batch-groups", "20", "--out", "quick-service"],
         "latency": ["--sizes", "1000,3000", "--queries", "50", "--out", "quick-service-latency"],
         "mixed": ["--prefill", "2000", "--duration", "5", "--out", "quick-mixed-load"],
         "http": ["--duration", "5", "--prefill", "2000", "--out", "quick-http"],
         "locomo": ["--limit", "1", "--out", "quick-locomo"],
         "replicas": ["--limit", "1", "--out", "quick-replicas"]}


def run_mem0(args):
    # mem0 lives in its own venv (its pins must not touch the server's); run it as a child process.
    subprocess.run([MEM0_PYTHON, "-m", "bench.mem0_side", *args], cwd=ROOT, check=True)


def run_part(part, args):
    if part == "mem0":
        run_mem0(args)
    elif part == "service":
        from bench import service_side
        service_side.main(args)
    elif part == "latency":
        from bench import service_latency
        service_latency.main(args)
    elif part == "mixed":
        from bench import mixed_load
        mixed_load.main(args)
    elif part == "http":
        from bench import http_load
        http_load.main(args)
    elif part == "locomo":
        from bench import locomo
        locomo.main(args or [LOCOMO])
    elif part == "replicas":
        from bench import replicas
        replicas.main(args or [LOCOMO])
    elif part == "report":
        # matplotlib is in the bench venv only (the server's venv stays lean).
        subprocess.run([MEM0_PYTHON, "-c", "from bench import report; print(report.write())"], cwd=ROOT, check=True)


def main():
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("part", nargs="?",
                   choices=["mem0", "service", "latency", "mixed", "http", "locomo", "replicas", "report"],
                   help="one part; omitted: all parts but replicas, then the report")
    p.add_argument("--quick", action="store_true", help="small sizes and short runs (smoke test; results quick-*.json)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the part (see `python -m bench PART -- -h`)")
    a = p.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    parts = [a.part] if a.part else ["mem0", "service", "latency", "mixed", "http", "locomo", "report"]
    if a.quick and "report" in parts:
        parts.remove("report")  # smoke numbers never go into docs/benchmarks.md
    for part in parts:
        args = rest
        if a.quick and part in QUICK:
            args = QUICK[part] + ([LOCOMO] if part in ("locomo", "replicas") and not rest else []) + rest
        run_part(part, args)


if __name__ == "__main__":
    sys.exit(main())
