"""A transport endpoint in its own process, driven by JSON lines on stdin (replies on stdout).

    python peer.py BACKEND CORE NBYTES
Starts BACKEND with the given core ("c" | "python"), allocates and registers NBYTES filled with
FILL, prints {"endpoint", "addr", "pid"}; then serves commands:
    {"op": "expect", "message", "timeout"}      -> {"ok", "error", "peer"} (or {"timeout": true})
    {"op": "dump", "path"}                       -> writes its buffer to path, {"done": true}
    {"op": "fill", "seed"}                       -> fills its buffer with random bytes of seed
    {"op": "send", "endpoint", "descs", "message", "die_after": bool}
        connect to a peer and write descs (list of rows); with die_after, the data path moves
        the first half of the descriptors and the process exits (a sender dying mid-transfer).
    {"op": "post", "endpoint", "descs", "message"}
        connect and write without waiting; polls the transfer once, replies {"status"} and
        leaves it in flight (nixl: nothing progresses it until the next command).
    {"op": "exit"}
"""

from __future__ import annotations

import base64
import json
import os
import sys
import types

import numpy as np

FILL = 0xA5


def faulty(core):
    """The core with its data path cut short: move the first half of the descriptors, then die."""

    def die() -> None:
        os._exit(3)

    def half(descs):
        return descs[: max(1, len(descs) // 2)]

    def copy_batch(descs):
        core.copy_batch(half(descs))
        die()

    def vm_write(pid, descs):
        core.vm_write(pid, half(descs))
        die()

    def send_iov(fd, descs, col, timeout_ms):
        core.send_iov(fd, half(descs), col, timeout_ms)
        die()

    return types.SimpleNamespace(build_descriptors=core.build_descriptors, vm_read=core.vm_read,
                                 recv_iov=core.recv_iov, copy_batch=copy_batch, vm_write=vm_write,
                                 send_iov=send_iov, IMPLEMENTATION=core.IMPLEMENTATION)


def make(backend: str, core_name: str, die: bool = False):
    import importlib

    from transport import _core
    from transport.select import BACKENDS

    module, cls = BACKENDS[backend]
    klass = getattr(importlib.import_module(module), cls)
    if backend == "nixl":
        return klass(timeout=30)
    core = _core.load(core_name)
    return klass(core=faulty(core) if die else core, timeout=30)


# Replies get a private copy of stdout; fd 1 itself goes to stderr (NIXL logs to stdout).
_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def reply(obj) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def main() -> None:
    backend, core_name, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    die = len(sys.argv) > 4 and sys.argv[4] == "die"
    t = make(backend, core_name, die)
    t.start()
    buf = t.allocate(nbytes)
    buf.array[:] = FILL
    t.register(buf.region)
    reply({"endpoint": base64.b64encode(t.endpoint()).decode(), "addr": buf.region.addr,
           "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "expect":
            try:
                n = t.wait_notification(cmd["message"].encode(), timeout=cmd["timeout"])
                reply({"ok": n.ok, "error": n.error, "peer": n.peer})
            except TimeoutError:
                reply({"timeout": True})
        elif op == "dump":
            with open(cmd["path"], "wb") as f:
                f.write(buf.array.tobytes())
            reply({"done": True})
        elif op == "fill":
            buf.array[:] = np.random.default_rng(cmd["seed"]).integers(0, 256, nbytes, dtype=np.uint8)
            reply({"done": True})
        elif op == "send":
            peer = t.connect(base64.b64decode(cmd["endpoint"]))
            descs = np.array(cmd["descs"], dtype=np.uint64).reshape(-1, 3)
            x = t.write(peer, descs, cmd["message"].encode())
            try:
                x.wait(cmd.get("timeout", 30))
                reply({"status": "DONE"})
            except Exception as e:
                reply({"status": "FAILED", "error": repr(e)})
        elif op == "post":
            peer = t.connect(base64.b64decode(cmd["endpoint"]))
            descs = np.array(cmd["descs"], dtype=np.uint64).reshape(-1, 3)
            x = t.write(peer, descs, cmd["message"].encode(), timeout=cmd.get("timeout", 60))
            reply({"status": x.status().value})
        elif op == "exit":
            break
    t.close()


if __name__ == "__main__":
    main()
