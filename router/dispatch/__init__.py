"""Dispatch modes, chosen once by name from DISPATCHERS (which also feeds the CLI)."""

from router.dispatch.base import Dispatcher, Env, Job, Outcome
from router.dispatch.direct import DirectDispatch
from router.dispatch.moriio import MoriioReadDispatch, MoriioWriteDispatch
from router.dispatch.pull import PullDispatch
from router.dispatch.push import PushDispatch

DISPATCHERS: dict[tuple[str, str], type] = {
    ("pull", "nixl"): PullDispatch,
    ("pull", "storage"): PullDispatch,
    ("push", "nixl"): PushDispatch,
    ("pull", "moriio"): MoriioReadDispatch,  # MoRIIO READ
    ("push", "moriio"): MoriioWriteDispatch,  # MoRIIO WRITE
}


def make_dispatcher(mode: str, connector: str, env: Env) -> Dispatcher:
    try:
        cls = DISPATCHERS[(mode, connector)]
    except KeyError:
        raise ValueError(f"no dispatcher for mode={mode} connector={connector}") from None
    return cls(env, connector=connector)


__all__ = ["DISPATCHERS", "make_dispatcher", "DirectDispatch", "Env", "Job", "Outcome", "Dispatcher"]
