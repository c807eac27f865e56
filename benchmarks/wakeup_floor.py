"""The CPU floor of one wake-up per streamed token on this machine (issue 8, round 4).

At low concurrency every token reaches the router alone, 10 ms after the one before: the
router sleeps, wakes, reads, writes, and sleeps again. This measures what that costs with no
router logic at all, so the router's CPU per request at c=1 can be read against it:

- `c-epoll`: a C echo server (epoll_wait, read, write), the cheapest design;
- `uvloop`: an asyncio Protocol echo on uvloop (the router's loop), `data_received` -> write.

Each server is pinned to one core; a client on another core sends a 300-byte message every
`--gap-ms` and waits for the echo. CPU = the server's scheduler runtime (schedstat) per echo.

    PYTHONPATH=. python -m benchmarks.wakeup_floor [--messages 500] [--gap-ms 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import pinned, runtime_s

C_ECHO = r"""
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1, c, ep, n;
    struct sockaddr_in a = {0};
    struct epoll_event ev = {0}, e;
    char b[65536];
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[1]));
    a.sin_addr.s_addr = htonl(0x7f000001);
    if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) return 1;
    write(1, "READY\n", 6);
    c = accept(l, 0, 0);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ep = epoll_create1(0);
    ev.events = EPOLLIN;
    ev.data.fd = c;
    epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
    for (;;) {
        if (epoll_wait(ep, &e, 1, -1) < 1) continue;
        n = read(c, b, sizeof b);
        if (n <= 0) return 0;
        write(c, b, n);
    }
}
"""

PY_ECHO = r"""
import asyncio, sys, uvloop
class Echo(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
    def data_received(self, d):
        self.t.write(d)
    def connection_lost(self, exc):
        asyncio.get_running_loop().stop()
async def main():
    await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", int(sys.argv[1]))
    print("READY", flush=True)
    await asyncio.Event().wait()
try:
    uvloop.run(main())
except RuntimeError:
    pass
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cmd: list[str], port: int, messages: int, gap_s: float, server_core: int) -> float:
    """CPU seconds of the server per echo."""
    proc = subprocess.Popen(pinned(cmd, server_core), stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{cmd[0]} did not start")
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"x" * 300
        for _ in range(20):  # warm-up
            s.sendall(msg)
            s.recv(65536)
        c0 = runtime_s(proc.pid)
        for _ in range(messages):
            s.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(s.recv(65536))
            time.sleep(gap_s)
        c1 = runtime_s(proc.pid)
        s.close()
        return (c1 - c0) / messages
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=500)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--client-core", type=int, default=1)
    a = p.parse_args(argv)
    if a.client_core < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.client_core})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if shutil.which("gcc"):
            src, exe = Path(tmp, "echo.c"), Path(tmp, "echo")
            src.write_text(C_ECHO)
            subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
            port = _free_port()
            rows.append(("c-epoll", measure([str(exe), str(port)], port, a.messages, a.gap_ms / 1000,
                                            a.server_core)))
        port = _free_port()
        rows.append(("uvloop", measure([sys.executable, "-c", PY_ECHO, str(port)], port, a.messages,
                                       a.gap_ms / 1000, a.server_core)))
    print("| server | CPU per wake-up (us) | x 64 tokens (ms) |")
    print("|---|---|---|")
    for name, cpu in rows:
        print(f"| {name} | {cpu * 1e6:.0f} | {cpu * 64e3:.2f} |")
    print(f"\n{a.messages} echoes of 300 bytes, one every {a.gap_ms:g} ms; server on core {a.server_core}, "
          f"client on core {a.client_core}; CPU = the server's scheduler runtime per echo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
