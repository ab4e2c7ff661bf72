"""Start a real `memory-server serve` on a free loopback port for the HTTP benchmarks."""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Server:
    url: str
    key: str
    pid: int
    data_dir: Path

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.key}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "memory-server"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("memory-server")
    if found:
        return [found]
    return [sys.executable, "-c", "from memory_server.cli import main; main()"]


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of a process and its live children (Linux /proc; the workers of
    `serve --workers N`), by kind of thread, to tell whether the client or the server is saturated
    and how much of the server's CPU the model takes: `model` (threads named `embedding*`, which
    run the model calls), `request` (`request_*`), `main` (each process's main thread: a worker's
    event loop, the supervisor's accepting), `other`, and `total`. Threads carry their names in the
    operating system (memory_server.timing.name_os_thread)."""
    kinds = dict.fromkeys(("model", "request", "main", "other", "total"), 0.0)
    processes = [stat.parent for stat in Path("/proc").glob("[0-9]*/stat") if _is_in_tree(stat, pid)]
    for process in processes:
        for task in process.glob("task/*"):
            try:
                comm = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            kind = ("main" if task.name == process.name else "model" if comm.startswith("embedding")
                    else "request" if comm.startswith("request_") else "other")
            kinds[kind] += seconds
            kinds["total"] += seconds
    return kinds


def _is_in_tree(stat: Path, pid: int) -> bool:
    """Whether /proc/N/stat is process `pid` or one of its children."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat.parent.name == str(pid) or fields[1] == str(pid)  # fields[1]: the parent's pid


@contextlib.contextmanager
def running_server(data_dir: Path | None = None, ready_timeout: float = 180.0, extra_env: dict | None = None):
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-server-")))
        port = _free_port()
        log_path = data_dir / "server.log"
        log = stack.enter_context(open(log_path, "w"))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(extra_env or {})}
        cmd = _cli() + ["serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready after {ready_timeout}s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
            key = (data_dir / "bootstrap-admin.key").read_text().strip()
            yield Server(url, key, proc.pid, data_dir)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
