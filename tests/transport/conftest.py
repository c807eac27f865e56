"""Fixtures for the transport suite: both cores, peer processes, transports closed after use."""

from __future__ import annotations

import pytest
from transport_testlib import Peer, load_core, make_transport


@pytest.fixture(params=["c", "python"])
def core(request):
    """Each test that takes ``core`` runs against the C extension and against its twin."""
    return load_core(request.param)


@pytest.fixture
def spawn():
    """spawn(backend, core, nbytes, die=False) -> Peer; every peer is closed after the test."""
    peers: list[Peer] = []

    def make(*args, **kw) -> Peer:
        peers.append(Peer(*args, **kw))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def transports():
    """make(backend, core) -> a started transport, closed after the test."""
    made = []

    def make(backend: str, core_mod=None, **kw):
        t = make_transport(backend, core_mod, **kw)
        made.append(t)
        t.start()
        return t

    yield make
    for t in reversed(made):
        t.close()
