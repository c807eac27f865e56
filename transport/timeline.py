"""Opt-in per-request timeline of the pdr connector, for finding where a request's time goes.

With ``PDR_TIMELINE=1`` in a vLLM instance's environment, the connector (``transport.connector``,
``transport.push_state``) logs one line per event: ``pdr timeline <unix time> <event> <request id>``
(wall clock, so lines of the prefill and the decode instance on one host can be merged; join them
by ``transport.kvmeta.base_request_id``). Off by default: nothing is logged and each call is one
flag test. Events, in the order of one push (P prefill instance, D decode instance):

- ``D_alloc`` (D scheduler: blocks allocated), ``D_register_send`` / ``D_register_answered`` (D
  worker thread, side channel to P), ``P_register_in`` (P side channel),
- ``P_request_finished`` (P scheduler), ``P_worker_sees_finished`` (P worker, one step later),
  ``P_write_start`` / ``P_write_acked`` (P writer thread), ``P_finished_sending`` (P scheduler),
- ``D_notification`` (D worker, ``get_finished``), ``D_finished_recving`` (D scheduler),
  ``D_scheduled_after_load`` (D scheduler: first step that computes the request),
  ``D_request_finished`` (D scheduler: generation ended).
"""

from __future__ import annotations

import logging
import os
import time

ENABLED = os.environ.get("PDR_TIMELINE", "") not in ("", "0")
log = logging.getLogger("pdr.timeline")


def tl(event: str, req_id: str) -> None:
    if ENABLED:
        log.warning("pdr timeline %.6f %s %s", time.time(), event, req_id)
