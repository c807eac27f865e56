"""PdrPushConnector's scheduler-side hooks, called the way vLLM's scheduler calls them, with
stand-in requests and block lists (needs vLLM importable; no server, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from transport.connector import PdrPushConnector  # noqa: E402


def make(role: str = "kv_both") -> PdrPushConnector:
    cfg = SimpleNamespace(kv_connector_extra_config={}, engine_id="e0", kv_role=role,
                          is_kv_producer=role != "kv_consumer")
    vcfg = SimpleNamespace(kv_transfer_config=cfg, cache_config=SimpleNamespace(block_size=16))
    return PdrPushConnector(vcfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=100))


class Blocks:
    def __init__(self, all_ids, new_ids):
        self._all, self._new = all_ids, new_ids

    def get_block_ids(self):
        return (list(self._all),)

    def get_unhashed_block_ids(self):
        return list(self._new)


def d_request(rid="cmpl-r-0-0123abcd", n=40):
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
              "remote_host": "10.0.0.1", "remote_port": 5600, "remote_request_id": "r"}
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(n)),
                           status=RequestStatus.WAITING)


def test_decode_registers_new_blocks_once():
    c = make("kv_consumer")
    req = d_request()
    assert c.get_num_new_matched_tokens(req, 16) == (24, True)  # a 16-token local hit
    c.update_state_after_alloc(req, Blocks([7, 8, 9], [8, 9]), 24)
    c.update_state_after_alloc(req, Blocks([7, 8, 9], []), 0)  # second call after the load: no-op
    meta = c.build_connector_meta(None).step
    (r,) = meta.recvs
    assert (r.req_id, r.base_id, r.block_ids, r.first_block, r.num_tokens) == (
        "cmpl-r-0-0123abcd", "cmpl-r-0", [8, 9], 1, 40)
    assert (r.remote_host, r.remote_port) == ("10.0.0.1", 5600)
    assert c.build_connector_meta(None).step.empty()  # handed over once
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)  # flag cleared: no second claim


def test_plain_requests_are_left_alone():
    c = make()
    req = SimpleNamespace(request_id="x", kv_transfer_params=None, prompt_token_ids=[1, 2],
                          status=RequestStatus.FINISHED_STOPPED)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.request_finished(req, [1]) == (False, None)
    assert c.build_connector_meta(None).step.empty() and not c.has_pending_push_work()


def test_prefill_holds_blocks_until_the_worker_reports_the_send():
    c = make("kv_producer")
    req = SimpleNamespace(request_id="cmpl-r-0-0123abcd", prompt_token_ids=list(range(40)),
                          kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
                          status=RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, params = c.request_finished(req, [4, 5, 6])
    assert delay is True and params["remote_engine_id"] == "e0" and params["transfer_mode"] == "push"
    (s,) = c.build_connector_meta(None).step.sends
    assert (s.req_id, s.base_id, s.block_ids, s.num_tokens) == ("cmpl-r-0-0123abcd", "cmpl-r-0", [4, 5, 6], 40)
    assert c.has_pending_push_work()
    c.update_connector_output(SimpleNamespace(finished_sending={"cmpl-r-0-0123abcd"}, finished_recving=set()))
    assert not c.has_pending_push_work()


def test_aborted_prefill_is_cancelled_not_held():
    c = make("kv_producer")
    req = SimpleNamespace(request_id="cmpl-r-0-0123abcd", prompt_token_ids=list(range(40)),
                          kv_transfer_params={"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    assert c.request_finished(req, [4, 5, 6]) == (False, None)
    assert c.build_connector_meta(None).step.cancel_sends == ["cmpl-r-0"]


def test_decode_aborted_while_waiting_is_cancelled_until_reported():
    c = make("kv_consumer")
    req = d_request()
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, Blocks([1, 2, 3], [1, 2, 3]), 40)
    c.build_connector_meta(None)
    req.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(req, [1, 2, 3]) == (False, None)  # vLLM itself delays the free
    assert c.build_connector_meta(None).step.cancel_recvs == [req.request_id]
    # once reported in finished_recving the request is no longer waiting: no second cancel
    c.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={req.request_id}))
    assert c.request_finished(req, [1, 2, 3]) == (False, None)
    assert c.build_connector_meta(None).step.empty()


def test_decode_aborted_before_it_was_scheduled_still_cancels_at_prefill():
    """No blocks, no registration yet (aborted in the waiting queue): the worker is still asked
    to tell the prefill side, so that P frees its blocks at once instead of after lease_s."""
    from transport.kvmeta import RemoteCancel

    c = make("kv_consumer")
    req = d_request()
    req.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(req, []) == (False, None)
    assert c.has_pending_push_work()
    step = c.build_connector_meta(None).step
    assert step.cancel_unscheduled == [RemoteCancel("cmpl-r-0", "10.0.0.1", 5600)]
    assert not step.cancel_recvs and not step.recvs
    assert c.request_finished(req, []) == (False, None)  # once
    assert c.build_connector_meta(None).step.empty()


def _parallel(**kw):
    base = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                prefill_context_parallel_size=1, decode_context_parallel_size=1)
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize("attr,flag", [("tensor_parallel_size", "--tensor-parallel-size 2"),
                                       ("pipeline_parallel_size", "--pipeline-parallel-size 2"),
                                       ("data_parallel_size", "--data-parallel-size 2")])
def test_unsupported_parallelism_fails_at_construction(attr, flag):
    cfg = SimpleNamespace(kv_connector_extra_config={}, engine_id="e0", kv_role="kv_both", is_kv_producer=True)
    vcfg = SimpleNamespace(kv_transfer_config=cfg, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=_parallel(**{attr: 2}))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=flag):
            PdrPushConnector(vcfg, role, SimpleNamespace(num_blocks=100))
    vcfg.parallel_config = _parallel()
    PdrPushConnector(vcfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=100))  # all 1: fine


def test_hybrid_kv_cache_groups_fail_at_construction():
    cfg = SimpleNamespace(kv_connector_extra_config={}, engine_id="e0", kv_role="kv_both", is_kv_producer=True)
    vcfg = SimpleNamespace(kv_transfer_config=cfg, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=_parallel())
    with pytest.raises(ValueError, match="one KV cache group, this model has 2"):
        PdrPushConnector(vcfg, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=100, kv_cache_groups=[1, 2]))
