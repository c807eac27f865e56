"""A per-instance circuit breaker: closed -> open after N consecutive failures ->
half-open after a cool-down (one probe request at a time) -> closed on success.

Pure state with an injected clock (the caller passes `now`); no I/O.
"""

from __future__ import annotations

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    __slots__ = ("threshold", "cooldown", "failures", "opened_at", "probing", "_state")

    def __init__(self, threshold: int = 5, cooldown: float = 10.0):
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self._state = CLOSED

    def state(self, now: float) -> str:
        if self._state == OPEN and now - self.opened_at >= self.cooldown:
            return HALF_OPEN
        return self._state

    def allows(self, now: float) -> bool:
        st = self.state(now)
        if st == CLOSED:
            return True
        if st == HALF_OPEN and not self.probing:
            return True
        return False

    def on_pick(self, now: float) -> None:
        """Called when a request is sent to the instance: a half-open breaker lets one probe through."""
        if self.state(now) == HALF_OPEN:
            self.probing = True

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures = 0
            self._state = CLOSED
            self.probing = False
            return
        self.failures += 1
        if self.state(now) == HALF_OPEN or self.failures >= self.threshold:
            self._state = OPEN
            self.opened_at = now
            self.probing = False
