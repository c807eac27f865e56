"""The registry's discovery semantics with an injected clock: expiry, refresh, health ownership."""

from __future__ import annotations

from router.registry import Registry
from router.settings import InstanceSpec


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def spec(port: int) -> InstanceSpec:
    return InstanceSpec(url=f"http://10.0.0.1:{port}")


def test_expiry_refresh_and_reregistration():
    clock, events = Clock(), []
    reg = Registry(clock=clock, on_change=lambda ev, inst: events.append((ev, inst.url)))
    static = reg.add_static("decode", spec(1))
    a, created = reg.upsert("decode", spec(2))
    assert created and a.last_seen == 100.0
    clock.t = 108.0
    assert reg.upsert("decode", spec(2)) == (a, False) and a.last_seen == 108.0
    clock.t = 117.0  # 9 s of silence: not yet more than the timeout
    assert reg.expire(9.0) == []
    clock.t = 117.5
    assert reg.expire(9.0) == [a]
    assert reg.get("decode", a.url) is None and reg.get("decode", static.url) is static  # static never expires
    assert events[-2:] == [("removed", a.url), ("expired", a.url)]
    b, created = reg.upsert("decode", spec(2))
    assert created and b is not a and reg.candidates("decode") == [static, b]


def test_health_is_the_probes_call_not_the_pings():
    clock = Clock()
    reg = Registry(clock=clock)
    inst, _ = reg.upsert("prefill", spec(3))
    reg.set_health(inst, False)
    clock.t += 1
    reg.upsert("prefill", spec(3))  # a heartbeat
    assert inst.healthy is False and reg.candidates("prefill") == []
    clock.t += 20
    reg.set_health(inst, True)  # a probe succeeds, but only pings keep a registered instance alive
    assert inst.last_seen == 101.0
    assert reg.expire(9.0) == [inst]


def test_table_is_bounded():
    reg = Registry(clock=Clock(), max_instances=3)
    for port in range(3):
        assert reg.upsert("decode", spec(port))[1]
    assert reg.upsert("decode", spec(99)) == (None, False)
    assert reg.upsert("decode", spec(0))[0] is not None  # refreshes still work when full
    assert len(reg) == 3
