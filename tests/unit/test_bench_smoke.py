"""The benchmark's load generator and report against a fake engine: requests, tokens and errors
are counted right. No timing assertions: only counts and shapes."""

from __future__ import annotations

import math

import pytest

from benchmarks import report
from benchmarks.loadgen import LoadGen, percentile, summarize
from launch.fake_engine import FakeEngine, Fault


@pytest.fixture
async def engine():
    async with FakeEngine(itl_s=0.002) as e:
        yield e


async def test_closed_loop_counts_requests_and_tokens(engine):
    gen = LoadGen(engine.url, prompt_chars=200, max_tokens=8)
    results = await gen.closed_loop(concurrency=4, duration=1.0)
    gen.close()
    assert len(results) >= 4
    assert all(r.error is None and r.status == 200 and r.done for r in results)
    assert all(r.tokens == 8 and len(r.gaps) == 7 for r in results)
    assert len(engine.requests) == len(results)
    assert engine.generation_tokens == 8 * len(results)
    assert engine.connections_accepted == 4  # one keep-alive connection per worker
    bodies = [q.body for q in engine.requests]
    assert all(b["stream"] is True and b["max_tokens"] == 8 and len(b["prompt"]) == 200 for b in bodies)
    assert len({b["prompt"] for b in bodies}) == len(bodies)  # distinct prompts
    s = summarize(results, min(r.t_start for r in results), 0.0, 1.0)
    assert s["requests_total"] == s["ok"] == len(results) and s["errors"] == 0
    assert s["tokens_total"] == 8 * len(results)
    assert s["ttft_p50_ms"] > 0 and s["itl_p99_ms"] >= s["itl_p50_ms"]


async def test_open_loop_sends_rate_times_duration(engine):
    gen = LoadGen(engine.url, prompt_chars=50, max_tokens=2)
    results = await gen.open_loop(rate=20, duration=0.5)
    gen.close()
    assert len(results) == math.ceil(20 * 0.5)
    assert len(engine.requests) == len(results)
    assert all(r.error is None and r.tokens == 2 for r in results)


@pytest.mark.parametrize("fault, expect", [
    (Fault(status=503, count=2), "status 503"),
    (Fault(drop_after_chunks=3, count=2), "connection"),
    (Fault(garbage=True, count=2), "tokens"),
])
async def test_errors_are_counted(engine, fault, expect):
    engine.fault = fault
    gen = LoadGen(engine.url, prompt_chars=50, max_tokens=5)
    results = [await gen.one() for _ in range(5)]
    gen.close()
    errors = [r.error for r in results if r.error is not None]
    assert len(errors) == 2 and all(expect in e for e in errors), errors
    assert all(r.tokens == 5 for r in results if r.error is None)
    s = summarize(results, min(r.t_start for r in results), 0.0, 10.0)
    assert s["errors"] == 2 and s["ok"] == 3


async def test_request_timeout_is_an_error(engine):
    engine.fault = Fault(hang=True, count=1)
    gen = LoadGen(engine.url, prompt_chars=10, max_tokens=1, timeout=0.2)
    r = await gen.one()
    ok = await gen.one()
    gen.close()
    assert r.error is not None and "no complete answer" in r.error
    assert ok.error is None and ok.tokens == 1


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(101))), 99) == 99.0


def _summary(ttft: float, itl: float, tok_s: float, errors: int = 0) -> dict:
    return {"ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "itl_p99_ms": itl, "e2e_p50_ms": 600.0,
            "tok_per_s": tok_s, "requests_total": 100, "errors": errors, "run_wall_s": 10.0,
            "loadgen_cpu_s": 1.0, "cpu_s": {"router": 0.5, "fakes": 1.0}}


def test_report_table_rows():
    def point(c, router_itl):
        return {"kind": "closed", "concurrency": c, "rate": None,
                "direct": _summary(20.0, 11.0, 100.0 * c), "router": _summary(25.0, router_itl, 90.0 * c)}
    results = {"config": {"concurrency": [1, 64], "rates": []}, "modes": {
        "pull": {"points": [point(1, 12.0), point(64, 20.0)]},
        "push": {"error": "router exited with 1\ntraceback"}}}
    text = report.table(results)
    lines = text.splitlines()
    assert len(lines) == 4
    assert "added TTFT p50 c=64" in lines[0]
    pull = lines[2].split(" | ")
    assert pull[1:4] == ["+5.0", "+5.0", "+10.0"]  # p50 +5 at both; p99 50 - 40 at c=64
    assert pull[4] == "5.00 / 5.00"  # 0.5 CPU s over 100 requests
    assert pull[5] == "90 (c=1; direct 100)"  # c=64 breaks the ITL budget (+9 ms)
    assert "not run: router exited with 1" in lines[3]


def test_wakeup_floor_prints_one_row_per_server(capsys):
    """benchmarks/wakeup_floor.py: real echo servers, a positive CPU figure per wake-up."""
    from benchmarks import wakeup_floor

    assert wakeup_floor.main(["--messages", "20", "--gap-ms", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "server" not in line]
    names = [r.split(" | ")[0].strip("| ") for r in rows]
    assert names[-1] == "uvloop" and set(names) <= {"c-epoll", "uvloop"}
    assert all(float(r.split(" | ")[1]) > 0 for r in rows)


def test_details_show_steal_and_the_router_stage_means():
    direct = {**_summary(20.0, 11.0, 6400.0), "steal_pct": {"cpu0": 1.0, "cpu1": 4.0}}
    router = {**_summary(23.0, 12.0, 6400.0), "steal_pct": {"cpu0": 31.4, "cpu1": 2.0},
              "router_stages_ms": {"tokenize": 0.1, "prefill_leg": 21.0, "handoff": 0.8}}
    line = report.details({"modes": {"pull": {"points": [
        {"kind": "closed", "concurrency": 64, "rate": None, "direct": direct, "router": router}]}}})
    assert "; steal 31%" in line
    assert line.endswith("router means tokenize 0.10, prefill_leg 21.00, handoff 0.80 ms")
    bare = report.details({"modes": {"pull": {"points": [
        {"kind": "closed", "concurrency": 1, "rate": None, "direct": _summary(20.0, 11.0, 96.0),
         "router": _summary(21.0, 11.0, 96.0)}]}}})
    assert "steal" not in bare and "router means" not in bare


def test_router_stages_and_steal_come_from_real_sources():
    """harness.router_stages parses a real Prometheus exposition (prometheus_client's own) over
    HTTP; harness.steal_ticks reads this machine's /proc/stat."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from benchmarks import harness

    reg = CollectorRegistry()
    leg = Histogram("pd_router_prefill_leg_seconds", "x", ["mode"], registry=reg)
    leg.labels("pull").observe(0.020)
    leg.labels("push").observe(0.030)
    Histogram("pd_router_tokenize_seconds", "x", registry=reg).observe(0.0001)
    Histogram("pd_router_other_seconds", "x", registry=reg).observe(1.0)
    text = generate_latest(reg)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got = harness.router_stages(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    assert set(got) == {"prefill_leg", "tokenize"}
    assert got["prefill_leg"] == (pytest.approx(0.050), 2.0)
    assert got["tokenize"] == (pytest.approx(0.0001), 1.0)
    steal = harness.steal_ticks()
    assert steal and all(k.startswith("cpu") and v >= 0 for k, v in steal.items())


def test_router_stages_of_a_router_without_metrics_here_is_empty():
    """vllm-router serves /metrics on its own port: its /metrics on the API port is a 404,
    which gives no stage means instead of failing the run."""
    import http.server
    import threading

    from benchmarks import harness

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert harness.router_stages(f"http://127.0.0.1:{srv.server_address[1]}") == {}
    finally:
        srv.shutdown()


def test_peer_router_command_lines():
    """The Rust router's two setups: NIXL pull P/D with the bench's engines, and every request
    to the decode engine; its Prometheus listener on a port of its own."""
    from benchmarks import bench_router

    pull = bench_router.peer_argv(["vllm-router"], mode="vllm-router-pull", prefill="http://p",
                                  decode="http://d", port=9000)
    direct = bench_router.peer_argv(["vllm-router"], mode="vllm-router-direct", prefill="http://p",
                                    decode="http://d", port=9000)
    for argv in (pull, direct):
        assert argv[:5] == ["vllm-router", "--host", "127.0.0.1", "--port", "9000"]
        assert argv[argv.index("--policy") + 1] == "round_robin"
        assert int(argv[argv.index("--prometheus-port") + 1]) not in (0, 9000)
    assert pull[-5:] == ["--vllm-pd-disaggregation", "--prefill", "http://p", "--decode", "http://d"]
    assert direct[-2:] == ["--worker-urls", "http://d"] and "--prefill" not in direct
    a = bench_router.parse_args(["--modes", "vllm-router-pull,vllm-router-direct", "--quick"])
    assert a.modes == ["vllm-router-pull", "vllm-router-direct"] and a.peer_cmd == "vllm-router"
