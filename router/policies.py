"""Routing policies: one decision method each, no I/O.

`pick(candidates, key)` returns one of `candidates` (never empty). `key` is an
opaque per-request value (the request id) a policy may hash; the built-ins ignore it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from router.registry import Instance


class Policy(Protocol):
    def pick(self, candidates: Sequence[Instance], key: str = "") -> Instance: ...


class RoundRobin:
    """Cycles through candidates; stable when the candidate list changes size."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Instance], key: str = "") -> Instance:
        inst = candidates[self._next % len(candidates)]
        self._next += 1
        return inst


class LeastLoaded:
    """Fewest requests in flight; ties broken round-robin."""

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def pick(self, candidates: Sequence[Instance], key: str = "") -> Instance:
        low = min(c.in_flight for c in candidates)
        return self._rr.pick([c for c in candidates if c.in_flight == low], key)


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()
