"""transport.timeline: the opt-in per-request event log (PDR_TIMELINE=1); no timing asserted."""

import logging

from transport import timeline
from transport.kvmeta import base_request_id


def test_off_by_default_logs_nothing(monkeypatch, caplog):
    monkeypatch.setattr(timeline, "ENABLED", False)
    with caplog.at_level(logging.DEBUG, logger="pdr.timeline"):
        timeline.tl("D_alloc", "cmpl-abc-0-1234abcd")
    assert not caplog.records


def test_on_logs_event_and_request_id(monkeypatch, caplog):
    monkeypatch.setattr(timeline, "ENABLED", True)
    with caplog.at_level(logging.DEBUG, logger="pdr.timeline"):
        timeline.tl("P_write_start", "cmpl-abc-0")
    (rec,) = caplog.records
    _, _, t, event, rid = rec.getMessage().split()
    assert float(t) > 0 and event == "P_write_start" and base_request_id(rid) == "cmpl-abc-0"
