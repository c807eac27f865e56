"""The two-GPU goodput benchmark's logic (issue 10) without GPUs: placement, router command lines,
what counts as a good request, the 90% crossing, and a whole sweep against fake engines (the
router and the load generator real), including a second call that only measures what is missing.
No timing assertions."""

from __future__ import annotations

import json
import os
import socket
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks import gpu_goodput as gg
from benchmarks.loadgen import Result
from launch.fake_engine import FakeEngine

TOKENIZER = Path.home() / ".cache/pd-router/tiny-llama-v1"


def args(**kw) -> Namespace:
    a = gg.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_each_engine_sees_its_own_gpu_first_and_the_peer_after_it():
    eng = gg.make_engines(("0", "1"), args())
    vis = {e.name: e.env["CUDA_VISIBLE_DEVICES"] for s in eng.values() for e in s}
    assert vis == {"mono-a": "0,1", "mono-b": "1,0", "pull-p": "0,1", "pull-d": "1,0", "push-p": "0,1",
                   "push-d": "1,0"}
    one = gg.make_engines(("0", "0"), args())  # the same logic on one GPU
    assert {e.env["CUDA_VISIBLE_DEVICES"] for s in one.values() for e in s} == {"0"}
    assert [e.role for e in eng["pull"]] == ["prefill", "decode"]
    assert {e.port for s in eng.values() for e in s} == {8000, 8001, 8100, 8200, 8300, 8400}
    gib = 2 ** 30
    sizes = {e.name: e.kv_bytes for s in gg.make_engines(("0", "1"), args(kv_prefill_gib=4, kv_decode_gib=30,
                                                                            kv_mono_gib=20)).values() for e in s}
    assert sizes == {"mono-a": 20 * gib, "mono-b": 20 * gib, "pull-p": 4 * gib, "push-p": 4 * gib,
                     "pull-d": 30 * gib, "push-d": 30 * gib}


def test_router_command_lines_per_setup():
    a = args(model="/m", threshold=512)
    eng = gg.make_engines(("0", "1"), a)
    mono = gg.router_argv("mono2", eng["mono2"], 9000, a)
    assert mono[mono.index("--threshold") + 1] == str(10 ** 9)
    assert [mono[i + 1] for i, x in enumerate(mono) if x == "--decode"] == ["http://127.0.0.1:8000",
                                                                            "http://127.0.0.1:8001"]
    assert "--prefill" not in mono and mono[mono.index("--policy") + 1] == "least_loaded"
    push = gg.router_argv("push", eng["push"], 9000, a)
    assert push[push.index("--mode") + 1] == "push" and push[push.index("--threshold") + 1] == "512"
    assert push[push.index("--prefill") + 1] == ("http://127.0.0.1:8300?engine_id=prefill-push-0&kv_host=127.0.0.1"
                                                 "&kv_port=5800&tp=1&pp=1")
    pull = gg.router_argv("pull", eng["pull"], 9000, a)
    assert pull[pull.index("--prefill") + 1] == "http://127.0.0.1:8100"
    assert pull[pull.index("--decode") + 1] == "http://127.0.0.1:8200"
    assert pull[pull.index("--tokenizer") + 1] == "/m"


def res(t_first=None, gaps=(), tokens=0, error=None) -> Result:
    r = Result(t_start=10.0, t_first=None if t_first is None else 10.0 + t_first, tokens=tokens, gaps=list(gaps),
               error=error)
    r.t_end = 20.0
    return r


def test_a_request_is_good_only_within_both_slos():
    good = res(0.5, [0.02] * 9, 10)
    slow_first = res(1.5, [0.02] * 9, 10)
    slow_tokens = res(0.2, [0.01] * 5 + [0.2] * 4, 10)  # mean 0.0944 s per token
    failed = res(0.1, [0.01] * 3, 4, error="got 4 tokens, wanted 10")
    assert gg.judge(good, 1.0, 0.05)[0] and not gg.judge(slow_first, 1.0, 0.05)[0]
    assert not gg.judge(slow_tokens, 1.0, 0.05)[0] and gg.judge(failed, 1.0, 0.05) == (False, None, None)
    assert gg.judge(slow_tokens, 1.0, 0.05)[2] == pytest.approx(0.85 / 9)
    s = gg.point_summary([good, slow_first, slow_tokens, failed], 4.0, 10.0, 1.0, 0.05, wall=10.0)
    assert (s["sent"], s["ok"], s["good"], s["attainment"]) == (4, 3, 1, 0.25)
    assert (s["ttft_ok"], s["tpot_ok"], s["errors"]) == (2, 2, 1)
    assert s["error_kinds"] == {"got 4 tokens, wanted 10": 1}
    assert s["out_tok_per_s"] == 3.0  # 30 tokens of the three complete answers in 10 s
    assert s["per_request"] == [[500.0, 20.0], [1500.0, 20.0], [200.0, 94.444], None]
    # the same requests under a tighter TPOT SLO, and under a looser one
    assert gg.rejudge(s, 1.0, 0.01) == {"rate": 4.0, "good": 0, "sent": 4, "attainment": 0.0}
    assert gg.rejudge(s, 1.0, 0.1)["good"] == 2
    assert gg.rejudge({"rate": 4.0, "attainment": 1.0}, 1.0, 0.01) is None  # no per-request numbers


def test_the_rate_at_90_percent():
    pts = [{"rate": r, "attainment": x} for r, x in ((4, 1.0), (8, 0.98), (12, 0.7), (16, 0.2))]
    m = gg.max_rate(pts)
    assert m["max_swept"] == 8 and m["crossing"] == pytest.approx(8 + 4 * 0.08 / 0.28, abs=0.01)
    assert gg.max_rate(pts[:2]) == {"max_swept": 8, "crossing": 8, "bound": "at least (no swept rate fell below)"}
    assert gg.max_rate([{"rate": 4, "attainment": 0.5}])["max_swept"] is None
    state = {"setups": {"mono2": {"points": {"4": pts[0], "8": pts[1], "12": pts[2]}},
                        "push": {"points": {"4": {"rate": 4, "attainment": 0.95}, "8": {"rate": 8, "attainment": 0.85}}}}}
    state["args"] = {"slo_ttft": 1.0}
    summary = gg.summarize_setups(state)
    assert summary["push"]["crossing"] == pytest.approx(4 + 4 * 0.05 / 0.1)
    assert summary["push"]["ratio_to_mono2"] == pytest.approx(6.0 / summary["mono2"]["crossing"], abs=0.01)


def test_every_setup_gets_the_same_schedule():
    a, b = gg.schedule(8, 30, 17, 1800, 2200), gg.schedule(8, 30, 17, 1800, 2200)
    assert a == b and 150 < len(a) < 350 and all(1800 <= n <= 2200 for _, n in a)
    assert gg.schedule(12, 30, 17, 1800, 2200) != a


def posts(fake: FakeEngine) -> int:
    return sum(1 for r in fake.requests if r.method == "POST")


def free_base() -> int:
    for base in range(21000, 40000, 1000):
        socks = []
        try:
            for off in (0, 1, 100, 200, 300, 400, 900, 901, 902):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", base + off))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").exists(), reason="tiny tokenizer not built (launch.tiny_model)")
async def test_a_sweep_against_fake_engines_then_a_second_call_measures_only_what_is_missing(tmp_path, monkeypatch):
    prompts = gg.Prompts(str(TOKENIZER), 17, 30000)
    monkeypatch.setattr(gg, "Prompts", lambda *a, **kw: prompts)  # one tokenizer load for the three calls
    base = free_base()
    roles = {0: "both", 1: "both", 100: "prefill", 200: "decode", 300: "prefill", 400: "decode"}
    fakes = [FakeEngine(port=base + off, role=role, itl_s=0.002, model="tiny", record=True)
             for off, role in roles.items()]
    for f in fakes:
        await f.start()
    common = ["--model", str(TOKENIZER), "--gpus", "0,0", "--base-port", str(base), "--duration", "1.5",
              "--drain", "5", "--prompt-min", "60", "--prompt-max", "90", "--max-tokens", "6", "--check-prompts", "1",
              "--check-tokens", "4", "--state", str(tmp_path / "state.json"), "--logdir", str(tmp_path / "logs"),
              "--out", str(tmp_path / "out"), "--budget", "120", "--corpus-chars", "30000", "--threshold", "1", "--also-itl", "1e-9"]
    try:
        assert await gg.amain(gg.parse_args(common + ["--setups", "mono2", "--rates", "4"])) == 0
        first = json.loads((tmp_path / "state.json").read_text())
        p2 = first["setups"]["mono2"]["points"]["4"]
        assert p2["sent"] == p2["ok"] == p2["good"] and p2["attainment"] == 1.0 and p2["errors"] == 0
        mono_requests = posts(fakes[0]) + posts(fakes[1])
        assert posts(fakes[0]) >= 1 and posts(fakes[1]) >= 1  # least_loaded over both replicas

        assert await gg.amain(gg.parse_args(common + ["--setups", "mono2,push,pull", "--rates", "4,8"])) == 0
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["setups"]["mono2"]["points"]["4"] == p2  # not measured again
        assert set(state["setups"]["mono2"]["points"]) == {"4", "8"}
        # the replicas' new requests: mono2's rate 8 and one greedy reference per P/D setup
        assert posts(fakes[0]) + posts(fakes[1]) - mono_requests == state["setups"]["mono2"]["points"]["8"]["sent"] + 2
        for name, (p, d) in (("pull", fakes[2:4]), ("push", fakes[4:6])):
            S = state["setups"][name]
            assert set(S["points"]) == {"4", "8"} and all(x["errors"] == 0 and x["attainment"] == 1.0
                                                          for x in S["points"].values())
            assert S["correctness"]["total"] == 1
            sent = 1 + sum(x["sent"] for x in S["points"].values())  # every request went through P and D
            assert posts(p) == posts(d) == sent, name
            assert set(S["decode_sources_sweep"]) == {"external_kv_transfer"}  # D computed no prompt token
        assert state["summary"]["push"]["ratio_to_mono2"] == 1.0
        md = (tmp_path / "out" / "results.md").read_text()
        assert "| 8 | 100% (" in md and "push" in md
        assert "Under TPOT <= 1e-06 ms" in md and "| 8 | 0% (" in md  # the same requests, an SLO none meets
        assert state["summary_also"]["1e-09"]["push"]["max_swept"] is None

        # an SLO nobody meets: the sweep stops at the first rate and says why; the other setup's
        # points do not carry over to a state measured under another SLO
        assert await gg.amain(gg.parse_args(common + ["--setups", "pull", "--rates", "4,8", "--slo-itl", "1e-9"])) == 0
        state = json.loads((tmp_path / "state.json").read_text())
        assert set(state["setups"]) == {"pull"} and set(state["setups"]["pull"]["points"]) == {"4"}
        assert state["setups"]["pull"]["points"]["4"]["attainment"] == 0.0
        assert any("rate 8: not run" in s for s in state["setups"]["pull"]["skipped"])
    finally:
        for f in fakes:
            await f.close()
    assert not os.path.exists(tmp_path / "state.json.tmp")
