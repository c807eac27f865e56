"""The threshold decision: pure, no I/O."""

from __future__ import annotations

DIRECT = "direct"
DISAGGREGATED = "disaggregated"


def plan(prompt_tokens: int, threshold: int, *, batch: bool = False, n: int = 1) -> tuple[str, str]:
    """Return (route, reason).

    Prompts with fewer tokens than the threshold go straight to a decode instance: a KV
    transfer would cost more than it saves. Batched prompts and n > 1 also go direct,
    because a prefill answers with one set of KV params per request, not per choice.
    """
    if batch:
        return DIRECT, "batch"
    if n > 1:
        return DIRECT, "n_gt_1"
    if prompt_tokens < threshold:
        return DIRECT, "below_threshold"
    return DISAGGREGATED, "above_threshold"
