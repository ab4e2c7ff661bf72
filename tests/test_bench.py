"""The benchmark's own arithmetic: what bench/ reports is only as right as the code that counts it.

The LoCoMo runner runs end to end against a real server on a small file in LoCoMo's layout (the
real dataset is CC BY-NC and never in the repository), so the recall it reports is checked against
answers worked out by hand.
"""

import asyncio
import json
import os
import threading
import time

import pytest
import sqlalchemy

from bench import http_load, locomo, report, server, workload
from bench.workload import iter_memories, memories, percentiles, queries, user_id
from conftest import make_settings, start_server
from memory_server.timing import name_os_thread


def test_percentiles_are_nearest_rank_in_milliseconds():
    latencies = [i / 1000 for i in range(1, 101)]  # 1 ms .. 100 ms
    result = percentiles(latencies)
    assert result == {"n": 100, "p50_ms": pytest.approx(50), "p95_ms": pytest.approx(95),
                      "p99_ms": pytest.approx(99), "mean_ms": pytest.approx(50.5)}
    assert percentiles([0.004]) == {"n": 1, "p50_ms": 4.0, "p95_ms": 4.0, "p99_ms": 4.0, "mean_ms": 4.0}
    assert percentiles([]) == {"n": 0}


def test_the_http_part_reads_server_timing_and_says_where_the_slowest_requests_spent_their_time():
    assert http_load.server_timing("queue;dur=1.5, embed;dur=2, db;desc=\"x\";dur=0.5, app;dur=5, odd") == {
        "queue": 0.0015, "embed": 0.002, "db": 0.0005, "app": 0.005}
    # 99 fast requests and one slow one that waited for a request thread.
    samples = [(0.010, "queue;dur=1, embed;dur=3, app;dur=6")] * 99 + [(0.110, "queue;dur=80, embed;dur=3, app;dur=86")]
    went = http_load.where_time_went(samples)
    assert went["n"] == 100
    slowest, overall = went["slowest_1%_ms"], went["all_ms"]
    assert slowest == pytest.approx({"latency": 110, "queue": 80, "embed": 3, "unnamed": 3, "outside": 24})
    assert overall["latency"] == pytest.approx(11) and overall["queue"] == pytest.approx(1.79)
    assert overall["unnamed"] == pytest.approx(2.01) and overall["outside"] == pytest.approx(4.2)
    assert http_load.where_time_went([]) == {}
    # The report turns each level's stages into one row per kind of request and share.
    table = report._where_time_went([{"workers": 2, "clients": 64, "stages": {"search": went}}, {"clients": 16}])
    rows = [line for line in table.splitlines() if line.startswith("| 2 | 64 |")]
    assert rows == ["| 2 | 64 | search | all | 11.0 | 1.8 | 3.0 | – | – | – | 2.0 | 4.2 |",
                    "| 2 | 64 | search | slowest 1% | 110.0 | 80.0 | 3.0 | – | – | – | 3.0 | 24.0 |"]
    assert report._where_time_went([{"clients": 16}]) == ""


def test_the_http_part_splits_the_servers_cpu_by_thread_and_says_what_the_model_alone_allows():
    # Threads named as the server names them burn CPU, then wait (a thread's CPU is read while it lives).
    burnt, done = threading.Barrier(3), threading.Event()

    def burn(name, seconds):
        name_os_thread(name)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        burnt.wait()
        done.wait()
    before = server.cpu_seconds(os.getpid())
    threads = [threading.Thread(target=burn, args=args) for args in (("embedding-batcher-0", 0.3), ("request_3", 0.15))]
    for thread in threads:
        thread.start()
    burnt.wait()
    after = server.cpu_seconds(os.getpid())
    done.set()
    for thread in threads:
        thread.join()
    used = {kind: seconds - before[kind] for kind, seconds in after.items()}
    assert used["model"] == pytest.approx(0.3, abs=0.05) and used["request"] == pytest.approx(0.15, abs=0.05)
    assert used["total"] == pytest.approx(sum(used[kind] for kind in ("model", "request", "main", "other")))

    # 2 cores; a request costs the server 6 ms (3 of them the model) and the load generator 0.5 ms.
    found = http_load.ceilings({"model": 3.0, "request": 2.0, "main": 0.8, "other": 0.2, "total": 6.0}, 0.5, 2, 64)
    assert found == pytest.approx({"rps_all_cores_busy": 2000 / 6.5, "rps_model_only": 2000 / 3.5,
                                   "min_mean_latency_model_only_ms": 64 * 3.5 / 2})  # 112 ms: over 100 at best
    level = {"workers": 2, "clients": 64, "ceilings": found, "client_cpu_ms_per_request": 0.5,
             "server_cpu_ms_per_request": {"model": 3.0, "request": 2.0, "main": 0.8, "other": 0.2, "total": 6.0}}
    rows = [line for line in report._ceilings([level, {"clients": 16}]).splitlines() if line.startswith("| 2 |")]
    assert rows == ["| 2 | 64 | 3.00 | 2.00 | 0.80 | 0.20 | 6.00 | 0.50 | 307.7 | 571.4 | 112.0 |"]
    assert report._ceilings([{"clients": 16}]) == ""


def test_the_workload_is_seeded_and_spreads_memories_over_all_users():
    first = memories(2000)
    assert first == memories(2000) == list(iter_memories(2000))  # the same data on both sides, every run
    assert memories(2000, seed=8) != first
    assert len({user for user, _ in first[:1000]}) == 1000  # any prefix of 1,000 spans every user
    assert first[1000][0] == first[0][0] == user_id(0) == "user-0000"
    assert all(text.endswith(".") and text[0].isupper() for _, text in first)
    assert queries(50) == queries(50) and len({q for _, q in queries(500)}) > 100


def test_a_result_records_the_machine_speed_at_its_start_and_end(tmp_path, monkeypatch):
    monkeypatch.setattr(workload, "RESULTS_DIR", tmp_path)
    result = {"machine": workload.machine(), "sizes": {}}
    start = result["machine"]["python_loop_s"]
    assert 0 < start < 60
    path = workload.write_result("speed", result)
    assert path == tmp_path / "speed.json"
    written = json.loads(path.read_text())["machine"]
    assert written["python_loop_s"] == start and 0 < written["python_loop_s_at_end"] < 60
    assert report._conditions({"loadavg_1m": 0.42, "python_loop_s": 0.86, "python_loop_s_at_end": 1.35}) == \
        " (load 0.4, loop 0.86→1.35 s)"
    assert report._conditions({"loadavg_1m": 1.5}) == " (load 1.5)"
    assert report._conditions({}) == ""


def test_locomo_evidence_ids_are_normalised():
    assert locomo.evidence_ids(["D1:3"]) == ["D1:3"]
    assert locomo.evidence_ids(["D:11:26", "D30:05"]) == ["D11:26", "D30:5"]
    assert locomo.evidence_ids(["D8:6; D9:17"]) == ["D8:6", "D9:17"]
    assert locomo.evidence_ids([]) == locomo.evidence_ids(None) == []


def _conversation(sample_id: str, speakers: tuple[str, str], sessions: dict[int, list[tuple[str, str]]], qa: list):
    conversation = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
    for n, turns in sessions.items():
        conversation[f"session_{n}_date_time"] = f"1:00 pm on {n} May, 2023"
        conversation[f"session_{n}"] = [
            {"speaker": speakers[i % 2], "dia_id": f"D{n}:{i + 1}", "text": text, **({"blip_caption": caption} if caption else {})}
            for i, (text, caption) in enumerate(turns)]
    return {"sample_id": sample_id, "conversation": conversation, "qa": qa}


SAMPLES = [
    _conversation("conv-a", ("Caroline", "Melanie"), {
        # session_10 sorts before session_2 as text; the runner orders sessions by number.
        10: [("I finally adopted a greyhound and named him Biscuit.", None), ("Congratulations, he looks lovely!", None)],
        2: [("I started pottery classes on Thursdays.", "a photo of a clay bowl"), ("That sounds relaxing.", None)],
    }, [
        {"question": "What did Caroline name her greyhound?", "answer": "Biscuit", "evidence": ["D10:1"], "category": 4},
        {"question": "Which classes did Caroline start, and what did she make?", "answer": "pottery, a bowl",
         "evidence": ["D2:1", "D:99:1"], "category": 1},  # the second id names no turn: it stays in the denominator
        {"question": "What is Melanie's favourite film?", "evidence": [], "category": 5},
    ]),
    _conversation("conv-b", ("Jon", "Gina"), {
        1: [("My dance studio opens in the spring.", None), ("Gina, your greyhound photos are great.", None)],
    }, [
        {"question": "When does Jon's dance studio open?", "answer": "spring", "evidence": ["D1:1"], "category": 2},
    ]),
]


def test_locomo_turns_follow_the_protocol():
    turns = list(locomo.turns(SAMPLES[0]))
    assert [dia for dia, *_ in turns] == ["D2:1", "D2:2", "D10:1", "D10:2"]
    assert turns[0] == ("D2:1", 'Caroline said, "I started pottery classes on Thursdays." and shared a photo of a clay bowl',
                        2, "1:00 pm on 2 May, 2023")
    assert turns[1][1] == 'Melanie said, "That sounds relaxing."'


@pytest.fixture
def sqlite_server(tmp_path, embedder):
    live, stop = start_server(make_settings(tmp_path / "data"), embedder)
    yield live
    stop()


def test_the_load_clients_read_every_response_whole_on_connections_kept_alive(sqlite_server, tmp_path):
    """Part 3's client (http_load.Connection) against a real server: searches and adds on kept-alive
    connections, every answer read whole, Server-Timing recorded, refusals counted as errors."""
    live = server.Server(sqlite_server.url, sqlite_server.admin_key, os.getpid(), tmp_path)
    lat, errors, timings = asyncio.run(http_load._load(live, clients=4, duration=1.5, search_share=0.5, seed=5))
    assert errors == {} and lat["search"] and lat["add"]
    assert {len(lat[op]) for op in lat} == {len(timings[op]) for op in timings}
    assert all("app" in http_load.server_timing(header) for _, header in timings["search"] + timings["add"])
    with sqlite_server.client() as client:  # every add landed, its text as sent
        stored = client.post("/v1/memories/search", json={"query": "Load test note", "mode": "keyword", "top_k": 100,
                                                          "filters": {"user_id": {"in": [user_id(i) for i in range(1000)]}}})
        assert stored.status_code == 200, stored.text
        assert len(stored.json()["results"]) == min(100, len(lat["add"]))
    stranger = server.Server(sqlite_server.url, "ms_not-a-key", os.getpid(), tmp_path)
    lat, errors, _ = asyncio.run(http_load._load(stranger, clients=2, duration=0.5, search_share=1.0, seed=5))
    assert lat == {"search": [], "add": []} and list(errors) == ["HTTP 401"] and errors["HTTP 401"] > 2


def test_the_load_client_reads_chunked_responses_in_pieces_and_reports_a_closed_connection():
    """Responses may come chunked and in any number of pieces; a server that closes the connection
    fails the request waiting on it instead of leaving it hanging."""
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nServer-Timing: app;dur=2\r\n\r\n4\r\n{\"a\"",
              b"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n",
              b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"]

    async def serve(reader, writer):
        for expected in range(3):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if expected == 2:
                writer.close()  # the third request gets no answer
                return
            for piece in (pieces[:2] if expected == 0 else pieces[2:]):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)

    async def run():
        listening = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        connection = await http_load.Connection.open("127.0.0.1", port)
        head = b"POST /x HTTP/1.1\r\nHost: here\r\n"
        first = await connection.request(head, b"{}", timeout=5)
        second = await connection.request(head, b"{}", timeout=5)
        with pytest.raises(ConnectionResetError):
            await connection.request(head, b"{}", timeout=5)
        listening.close()
        return first, second

    (status, headers, body), second = asyncio.run(run())
    assert (status, headers["server-timing"], json.loads(body)) == (200, "app;dur=2", {"a": 1})
    assert second == (404, {"content-length": "2"}, b"{}")


def test_locomo_runner_scores_a_file_in_locomo_layout_through_the_server(sqlite_server, tmp_path):
    path = tmp_path / "mini-locomo.json"
    path.write_text(json.dumps(SAMPLES))
    with sqlite_server.client() as client:
        result = locomo.run(client, path)

        # Every turn is a memory of its conversation's scope, with its dia_id and session date.
        stored = client.get("/v1/memories", params={"user_id": "conv-a"}).json()["results"]
        assert sorted(m["metadata"]["dia_id"] for m in stored) == ["D10:1", "D10:2", "D2:1", "D2:2"]
        biscuit = next(m for m in stored if m["metadata"]["dia_id"] == "D10:1")
        assert biscuit["memory"] == 'Caroline said, "I finally adopted a greyhound and named him Biscuit."'
        assert biscuit["metadata"]["date"] == "1:00 pm on 10 May, 2023" and biscuit["metadata"]["session"] == 10

    assert result["conversations"] == 2 and result["questions"] == 4
    assert result["load"] == {"turns": 6, "events": {"ADD": 6}}
    assert set(result["modes"]) == {"dense", "keyword", "hybrid"}
    for mode, scores in result["modes"].items():
        assert set(scores) == {"single-hop", "multi-hop", "adversarial", "temporal", "overall"}, mode
        assert scores["overall"]["n"] == 4
        # A question without evidence counts as found at every k.
        assert all(scores["adversarial"][f"recall@{k}"] == 1.0 for k in locomo.KS), mode
        # Conversation a has 4 turns, b has 2: with top_k 25 every turn of the scope comes back, so
        # recall@25 is exact: 1 where every evidence id names a turn, 1/2 where one of two names none.
        assert scores["single-hop"]["recall@25"] == scores["temporal"]["recall@25"] == 1.0, mode
        assert scores["multi-hop"]["recall@25"] == 0.5, mode
        assert scores["overall"]["recall@25"] == pytest.approx((1 + 0.5 + 1 + 1) / 4), mode
        # Conversation b's greyhound turn never answers conversation a's question: scopes stay apart.
        assert scores["single-hop"]["recall@1"] == 1.0, mode
    assert result["modes"]["keyword"]["temporal"]["recall@1"] == 1.0
    for k in locomo.KS:  # the overall figure is the question-weighted mean of the categories
        categories = [v for name, v in result["modes"]["hybrid"].items() if name != "overall"]
        mean = sum(v["n"] * v[f"recall@{k}"] for v in categories) / sum(v["n"] for v in categories)
        assert result["modes"]["hybrid"]["overall"][f"recall@{k}"] == pytest.approx(mean)


def test_the_mixed_load_part_runs_searches_beside_long_adds_and_counts_both(tmp_path):
    from bench import mixed_load
    from bench.service_side import ServiceSide

    side = ServiceSide(tmp_path)
    try:
        side.fill(memories(200))
        result = mixed_load.run(side, searchers=2, adders=1, seconds=1.5)
        with side.rt.engine.connect() as connection:
            stored = connection.execute(sqlalchemy.text("SELECT count(*) FROM memories")).scalar_one()
    finally:
        side.close()
    assert result["search"]["n"] > 0 and result["add"]["n"] > 0
    assert result["searches_per_s"] == pytest.approx(result["search"]["n"] / result["seconds"])
    assert result["cpu_ms_per_operation"] > 0
    assert stored == 200 + result["add"]["n"]  # every timed add wrote a new memory (the turns differ)


def test_two_replicas_of_a_locomo_store_answer_every_question_alike(tmp_path, embedder):
    from bench import replicas

    settings = make_settings(tmp_path / "data")
    live, stop = start_server(settings, embedder)
    try:
        with live.client() as client:
            locomo.load(client, SAMPLES)
    finally:
        stop()
    result = replicas.compare(settings, SAMPLES, embedder=embedder)
    assert result["questions"] == 4 and result["points"] == [6, 6]
    assert (settings.data_dir / "index-1").is_dir()  # the second runtime built an index of its own
    assert result["modes"] == {mode: {"top5_set_differs": 0, "set_differs": 0, "order_differs": 0}
                               for mode in ("dense", "keyword", "hybrid")}
    assert result["same_index_twice_order_differs"] == 0
