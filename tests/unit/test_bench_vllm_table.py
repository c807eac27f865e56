"""benchmarks.bench_vllm's table: rows per load point, ratios to the mono row. No timing checks."""

from __future__ import annotations

from benchmarks.bench_vllm import LABELS, summary, table


def _point(setup: str, ttft: float, itl: float | None = 4.0, errors: int = 0) -> dict:
    return {"setup": setup, "prompt_tokens": 300, "rate_set": 1.0, "ok": 10 - errors, "requests_measured": 10,
            "requests_total": 12, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "itl_p50_ms": itl,
            "itl_p99_ms": itl, "tok_per_s": 32.0, "errors": errors, "load_before": 1.0, "load_after": 2.0}


def test_router_rows_are_ratios_to_mono():
    lines = table([_point("pull", 30.0), _point("mono", 20.0), _point("router-direct", 22.0, itl=None)]).splitlines()
    assert len(lines) == 2 + 3
    assert LABELS["mono"] in lines[2] and LABELS["router-direct"] in lines[3] and LABELS["pull"] in lines[4]
    mono, direct, pull = (line.split(" | ") for line in lines[2:])
    assert mono[-5:] == ["1.00x"] * 4 + ["1.00x |"]
    assert direct[10] == "1.10x" and direct[11] == "1.10x" and direct[12] == "n/a"
    assert pull[10] == "1.50x"
    assert all(len(line.split("|")) == len(lines[0].split("|")) for line in lines)


def test_missing_mono_gives_na_and_summary_lists_failures():
    res = {"points": [_point("push", 30.0, errors=2)], "checks": {"reference@300": "x", "push@300": False},
           "sources": {"push": {"decode": {"local_compute": 0, "external_kv_transfer": 3000}}},
           "startup_s": {"push": 60.0}, "errors": {"push": "boom"}}
    text = summary(res)
    assert "n/a" in text.splitlines()[2]
    assert "push@300 NO" in text and "FAILED push: boom" in text and "local_compute=0" in text


def test_ratios_to_another_reference_setup():
    points = [_point("pdr", 20.0), _point("push", 30.0), _point("pull", 10.0)]
    lines = table(points, reference="pdr").splitlines()
    assert "TTFT p50 / (e)" in lines[0]
    rows = {r.split(" | ")[2]: r.split(" | ") for r in lines[2:]}
    assert rows[LABELS["pdr"]][10] == "1.00x"
    assert rows[LABELS["push"]][10] == "1.50x" and rows[LABELS["pull"]][10] == "0.50x"
    res = {"points": points, "checks": {}, "sources": {}, "startup_s": {}, "errors": {},
           "connector": {"pdr": {"prefill": {"vllm:pdr_kv_sent_bytes_total": 4096.0},
                                 "decode": {"vllm:pdr_kv_received_bytes_total": 4096.0}}}}
    text = summary(res, "pdr")
    assert "pdr_kv_sent_bytes_total=4096" in text and "pdr_kv_received_bytes_total=4096" in text


def test_the_rust_router_rows_sit_beside_pd_routers():
    """--peer-cmd rows: vllm-router with one worker right after (b), its NIXL pull right after (c),
    both as ratios to mono like every other row."""
    points = [_point(s, t) for s, t in (("vr-pull", 28.0), ("pull", 30.0), ("vr-direct", 21.0),
                                        ("router-direct", 22.0), ("mono", 20.0))]
    lines = table(points).splitlines()
    setups = [line.split(" | ")[2] for line in lines[2:]]
    assert setups == [LABELS[s] for s in ("mono", "router-direct", "vr-direct", "pull", "vr-pull")]
    rows = {r.split(" | ")[2]: r.split(" | ") for r in lines[2:]}
    assert rows[LABELS["vr-direct"]][10] == "1.05x" and rows[LABELS["vr-pull"]][10] == "1.40x"
