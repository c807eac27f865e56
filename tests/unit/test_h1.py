"""router/h1.py, the router's HTTP/1.1 client, against scripted raw-socket servers."""

from __future__ import annotations

import asyncio

import pytest

from router import h1
from router.errors import BadRequest, UpstreamError, UpstreamStatus, UpstreamTimeout
from router.upstream import Upstream

OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Script:
    """A raw TCP server; `handler(reader, writer, n)` serves the n-th connection."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server = None

    async def __aenter__(self):
        async def serve(reader, writer):
            self.connections += 1
            try:
                await self.handler(self, reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def read_request(self, reader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length) if length else b""
        self.requests.append(head + body)
        return head + body


async def _stream(pool, port, **kw) -> h1.Stream:
    return await h1.open_stream(pool, "POST", "127.0.0.1", port, "/v1/completions", b'{"x":1}',
                                {"content-type": "application/json", "x-request-id": "r1"},
                                timeout=kw.pop("timeout", 5), stage="decode", **kw)


async def test_request_bytes_and_chunks_of_one_read_arrive_as_one_piece():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        # three HTTP chunks in one write: the relay must see them as one piece (one client write)
        writer.write(OK_HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n") + chunk(b"data: 3\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with Script(handler) as s:
        pool = h1.Pool()
        st = await _stream(pool, s.port)
        assert st.status == 200 and st.headers["content-type"] == "text/event-stream"
        got, ended = [], asyncio.Event()
        first = await st.first(5)
        st.attach(got.append, ended.set, lambda e: pytest.fail(f"error {e}"))
        await asyncio.wait_for(ended.wait(), 5)
        assert first == b"data: 1\n\ndata: 2\n\ndata: 3\n\n" and got == [b"data: [DONE]\n\n"]
        req = s.requests[0]
        assert req.startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % s.port)
        assert b"content-length: 7\r\n" in req and b"x-request-id: r1\r\n" in req and req.endswith(b'{"x":1}')
        await st.aclose()
        pool.close()


async def test_keep_alive_reuses_one_connection_and_a_stale_one_is_retried():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        writer.write(OK_HEAD + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        if n == 1:  # keep-alive: a second request on the same connection, then the server times it out
            await s.read_request(reader)
            writer.write(OK_HEAD + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return  # closes the idle connection
        await reader.read()

    async with Script(handler) as s:
        up = Upstream()
        url = f"http://127.0.0.1:{s.port}/v1/completions"
        for _ in range(2):
            r = await up.request("POST", url, body=b"{}", headers={}, timeout=5)
            assert r.status == 200 and r.body == b"data: [DONE]\n\n"
        assert s.connections == 1 and up.pool.opened == 1
        await asyncio.sleep(0.1)  # the server closed the pooled connection meanwhile
        r = await up.request("POST", url, body=b"{}", headers={}, timeout=5)
        assert r.status == 200 and s.connections == 2
        await up.aclose()


async def test_a_pooled_connection_closed_before_the_answer_is_retried_once():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if n == 1:
            await s.read_request(reader)  # the second request arrives, then the connection drops unanswered
            return
        await reader.read()

    async with Script(handler) as s:
        up = Upstream()
        url = f"http://127.0.0.1:{s.port}/x"
        assert (await up.request("POST", url, body=b"{}", timeout=5)).body == b"ok"
        assert (await up.request("POST", url, body=b"{}", timeout=5)).body == b"ok"
        assert s.connections == 2 and len(s.requests) == 3
        await up.aclose()


async def test_start_sends_on_an_idle_connection_before_yielding_and_is_not_resent():
    """`start` (push's prefill leg): the request is written in the caller's step, on an idle
    pooled connection only; `post(started=)` waits for that answer without a second write."""
    async def handler(s, reader, writer, n):
        while True:
            body = await s.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()

    async with Script(handler) as s:
        up = Upstream()
        url = f"http://127.0.0.1:{s.port}/x"
        assert up.start(url, b"{}", {}, stage="prefill") is None  # nothing idle: no connection is made here
        assert up.pool.opened == 0
        assert (await up.post(url, b"{}", {}, timeout=5, stage="prefill")).status == 200
        started = up.start(url, b'{"n":2}', {"x-request-id": "r2"}, stage="prefill")
        assert started is not None and started.conn.transport.get_write_buffer_size() == 0  # already written
        reply = await up.post(url, b'{"n":2}', {"x-request-id": "r2"}, timeout=5, stage="prefill", started=started)
        assert reply.status == 200 and reply.body.endswith(b'{"n":2}')
        assert b"x-request-id: r2" in reply.body
        assert len(s.requests) == 2 and s.connections == 1 and up.pool.opened == 1
        await up.aclose()


async def test_a_started_request_on_a_stale_connection_is_retried_and_an_unused_one_closed():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if n == 1:
            await s.read_request(reader)  # the started request arrives, then the connection drops unanswered
            return
        await reader.read()

    async with Script(handler) as s:
        up = Upstream()
        url = f"http://127.0.0.1:{s.port}/x"
        assert (await up.post(url, b"{}", {}, timeout=5, stage="prefill")).body == b"ok"
        started = up.start(url, b"{}", {}, stage="prefill")
        assert started is not None
        assert (await up.post(url, b"{}", {}, timeout=5, stage="prefill", started=started)).body == b"ok"
        assert s.connections == 2 and len(s.requests) == 3
        # a started request nobody waits for: aclose() closes its connection (never pooled)
        unused = up.start(url, b"{}", {}, stage="prefill")
        assert unused is not None
        await unused.aclose()
        assert unused.conn.transport.is_closing() and up.pool.take_idle("127.0.0.1", s.port) is None
        await up.aclose()


async def test_until_body_waits_for_the_first_bytes_after_an_early_head():
    """vLLM sends a stream's head before prefill: with until_body the caller is woken once, when
    the first token is in; error statuses and empty bodies still return at once; the timeout
    covers the first bytes."""
    go = asyncio.Event()

    async def handler(s, reader, writer, n):
        while True:
            req = await s.read_request(reader)
            if b"/err" in req:
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
            elif b"/empty" in req:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            else:
                writer.write(OK_HEAD)
                await writer.drain()
                if b"/silent" in req:
                    await reader.read()
                    return
                await go.wait()
                go.clear()
                writer.write(chunk(b"data: 1\n\n"))
            await writer.drain()

    async with Script(handler) as s:
        pool = h1.Pool()

        async def open_(path, until_body, timeout=5):
            return await h1.open_stream(pool, "POST", "127.0.0.1", s.port, path, b"{}", {}, timeout=timeout,
                                        stage="decode", until_body=until_body)

        plain = await open_("/x", False)  # returns at the head; the token is still to come
        assert plain.status == 200 and not plain._buf
        go.set()
        assert await plain.first(5) == b"data: 1\n\n"
        await plain.aclose()

        task = asyncio.create_task(open_("/x", True))
        await asyncio.sleep(0.2)
        assert not task.done()  # the head is in, the first token is not: still waiting
        go.set()
        held = await task
        assert held.status == 200 and held._buf == [b"data: 1\n\n"]
        assert await held.first(5) == b"data: 1\n\n"
        await held.aclose()

        err = await open_("/err", True)
        assert err.status == 503 and await err.read_all(5) == b"busy"
        empty = await open_("/empty", True)
        assert empty.status == 200 and empty.done and await empty.first(5) == b""
        with pytest.raises(UpstreamTimeout, match="did not answer within 0.2s"):
            await open_("/silent", True, timeout=0.2)
        pool.close()


async def test_fetch_wakes_once_for_a_head_and_body_written_apart():
    """uvicorn (vLLM's server) writes a JSON answer's head and body in two writes: fetch's
    open_stream(until_end) returns only when the whole answer is in, for any status; a timeout
    still covers the body; a connection lost after the head is the connection's error."""
    go = asyncio.Event()

    async def handler(s, reader, writer, n):
        while True:
            req = await s.read_request(reader)
            status = b"503 Service Unavailable" if b"/err" in req else b"200 OK"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 7\r\n\r\n")
            await writer.drain()
            if b"/silent" in req:
                await reader.read()
                return
            if b"/cut" in req:
                writer.close()
                return
            await go.wait()
            go.clear()
            writer.write(b'{"a":1}')
            await writer.drain()

    async with Script(handler) as s:
        pool = h1.Pool()
        for path, want in (("/x", 200), ("/err", 503)):
            task = asyncio.create_task(h1.open_stream(pool, "POST", "127.0.0.1", s.port, path, b"{}", {},
                                                      timeout=5, stage="prefill", until_end=True))
            await asyncio.sleep(0.2)
            assert not task.done(), path  # the head is in, the body is not: still waiting
            go.set()
            stream = await task
            assert stream.status == want and stream.done and stream._buf == [b'{"a":1}']
            await stream.aclose()
            go.set()
            status, body, _ = await h1.fetch(pool, "POST", "127.0.0.1", s.port, path, b"{}", {}, timeout=5,
                                             stage="prefill")
            assert (status, body) == (want, b'{"a":1}')
        with pytest.raises(UpstreamTimeout, match="did not answer within 0.2s"):
            await h1.fetch(pool, "POST", "127.0.0.1", s.port, "/silent", b"{}", {}, timeout=0.2, stage="prefill")
        with pytest.raises(UpstreamError) as e:
            await h1.fetch(h1.Pool(), "POST", "127.0.0.1", s.port, "/cut", b"{}", {}, timeout=5, stage="prefill")
        assert e.value.code == "connection_lost"
        pool.close()


async def test_on_answer_runs_from_the_read_callback_before_the_caller_wakes(caplog):
    """fetch(on_answer=): the hook sees the whole answer from the connection's read callback
    (no task running), before fetch returns; not for a failed exchange; a hook that raises is
    logged and the answer is still returned."""
    async def handler(s, reader, writer, n):
        while True:
            req = await s.read_request(reader)
            if b"/cut" in req:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\npart")
                await writer.drain()
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b'{"a":1}')
            await writer.drain()

    async with Script(handler) as s:
        pool, calls = h1.Pool(), []

        def hook(stream):
            calls.append((asyncio.current_task(), stream.status, stream.body(), stream.done))

        status, body, _ = await h1.fetch(pool, "POST", "127.0.0.1", s.port, "/x", b"{}", {}, timeout=5,
                                         stage="prefill", on_answer=hook)
        assert (status, body) == (200, b'{"a":1}')
        assert calls == [(None, 200, b'{"a":1}', True)]

        def broken(stream):
            raise RuntimeError("bug in a hook")

        status, body, _ = await h1.fetch(pool, "POST", "127.0.0.1", s.port, "/x", b"{}", {}, timeout=5,
                                         stage="prefill", on_answer=broken)
        assert (status, body) == (200, b'{"a":1}')
        assert "answer hook of a prefill stream failed" in caplog.text
        with pytest.raises(UpstreamError):
            await h1.fetch(h1.Pool(), "POST", "127.0.0.1", s.port, "/cut", b"{}", {}, timeout=5, stage="prefill",
                           on_answer=hook)
        assert len(calls) == 1
        pool.close()


async def test_a_new_connection_dropped_before_the_answer_is_an_error_not_a_retry():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)  # then close without answering

    async with Script(handler) as s:
        with pytest.raises(UpstreamError) as e:
            await _stream(h1.Pool(), s.port)
        assert e.value.code == "connection_lost" and s.connections == 1


async def test_body_until_eof_content_length_and_error_status():
    async def handler(s, reader, writer, n):
        req = await s.read_request(reader)
        if b"/eof" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        else:
            writer.write(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 41\r\n\r\n{"error":{"message":"bad","type":"x"}}   ')
        await writer.drain()

    async with Script(handler) as s:
        up = Upstream()
        r = await up.request("GET", f"http://127.0.0.1:{s.port}/eof", timeout=5)
        assert r.status == 200 and r.body == b"all of it"
        assert s.requests[0].startswith(b"GET /eof HTTP/1.1\r\n") and b"content-length" not in s.requests[0]
        with pytest.raises(UpstreamStatus) as e:
            await up.open_stream(f"http://127.0.0.1:{s.port}/v1/completions", b"{}", {}, timeout=5, idle_timeout=5,
                                 stage="decode")
        assert e.value.engine_status == 400 and e.value.status == 400 and b'"bad"' in e.value.raw
        await up.aclose()


async def test_malformed_answer_truncated_stream_and_refused_connection():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        if n == 1:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        else:
            writer.write(OK_HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()  # cut mid-body
        await writer.drain()

    async with Script(handler) as s:
        pool = h1.Pool()
        with pytest.raises(UpstreamError) as e:
            await _stream(pool, s.port)
        assert e.value.code == "bad_response"
        st = await _stream(pool, s.port)
        errors, ended = [], asyncio.Event()
        st.attach(lambda b: None, ended.set, lambda err: (errors.append(err), ended.set()))
        await asyncio.wait_for(ended.wait(), 5)
        assert errors and errors[0].code == "connection_lost"
        await st.aclose()
    with pytest.raises(UpstreamError) as e:
        await _stream(h1.Pool(), s.port)
    assert e.value.code == "connect_error"


async def test_timeouts_head_first_byte_idle_and_deadline():
    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        if n == 1:
            await asyncio.sleep(5)  # no answer at all
        writer.write(OK_HEAD)
        await writer.drain()
        if n == 3:
            writer.write(chunk(b"data: 1\n\n"))
            await writer.drain()
        while True:  # n == 4: a token every 50 ms, never ending
            await asyncio.sleep(0.05)
            if n == 4:
                writer.write(chunk(b"data: t\n\n"))
                await writer.drain()

    async with Script(handler) as s:
        pool = h1.Pool()
        with pytest.raises(UpstreamTimeout, match="did not answer within 0.2s"):
            await _stream(pool, s.port, timeout=0.2)
        st = await _stream(pool, s.port)
        with pytest.raises(UpstreamTimeout, match="sent no data within 0.2s"):
            await st.first(0.2)
        await st.aclose()
        loop = asyncio.get_running_loop()
        for idle, deadline, match in ((0.2, None, "idle for more than 0.2s"),
                                      (10, loop.time() + 0.3, "request timeout reached")):
            st = await _stream(pool, s.port)
            st.set_limits(idle, deadline)
            errors, ended = [], asyncio.Event()
            st.attach(lambda b: None, ended.set, lambda err: (errors.append(err), ended.set()))
            await asyncio.wait_for(ended.wait(), 5)
            assert isinstance(errors[0], UpstreamTimeout) and match in errors[0].message
            await st.aclose()
        pool.close()


async def test_pause_reading_holds_the_engine_and_aclose_drops_the_connection():
    gone = asyncio.Event()

    async def handler(s, reader, writer, n):
        await s.read_request(reader)
        writer.write(OK_HEAD)
        try:
            for i in range(1000):
                writer.write(chunk(b"data: %d\n\n" % i))
                await writer.drain()
                await asyncio.sleep(0.001)
        except ConnectionError:
            pass
        gone.set()

    async with Script(handler) as s:
        st = await _stream(h1.Pool(), s.port)
        got = []
        st.attach(got.append, lambda: None, lambda e: None)
        await asyncio.sleep(0.05)
        st.pause_reading()
        await asyncio.sleep(0.02)
        held = len(got)
        await asyncio.sleep(0.1)
        assert len(got) == held  # nothing delivered while paused
        st.resume_reading()
        await asyncio.sleep(0.05)
        assert len(got) > held
        await st.aclose()  # unfinished: the connection is closed, the server sees it
        await asyncio.wait_for(gone.wait(), 5)


async def test_header_values_with_line_breaks_are_refused():
    with pytest.raises(BadRequest):
        h1.request_head("POST", "/x", "h:1", {"authorization": "Bearer a\r\nx-evil: 1"}, 0)


async def test_a_stream_paused_in_its_last_read_returns_a_reading_connection_to_the_pool():
    """The relay pauses the engine's socket from inside a chunk callback (client backpressure,
    or push waiting for P's usage) and that same read can end the answer. The connection then
    goes back to the pool: it must be reading again, or the next request on it never sees its
    answer (a push request once waited out the 60 s decode grace this way)."""

    async def handler(s, reader, writer, n):
        for _ in range(2):
            await s.read_request(reader)
            writer.write(OK_HEAD)
            await writer.drain()
            await asyncio.sleep(0.05)  # the body comes later, in one write: one read ends the answer
            writer.write(chunk(b"data: 1\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        await reader.read()

    async with Script(handler) as s:
        pool = h1.Pool()
        st = await _stream(pool, s.port)
        assert not st.done
        ended = asyncio.Event()

        def on_chunk(body: bytes) -> None:
            st.pause_reading()  # held by the consumer; the same read then completes the answer

        st.attach(on_chunk, ended.set, lambda e: pytest.fail(f"error {e}"))
        await asyncio.wait_for(ended.wait(), 5)
        st.resume_reading()  # the consumer lets go after the end: nothing to resume any more
        await st.aclose()
        st2 = await _stream(pool, s.port, timeout=2)  # same connection, from the pool
        assert await st2.first(2) == b"data: 1\n\ndata: [DONE]\n\n"  # a paused connection: timeout
        assert s.connections == 1
        await st2.aclose()
        pool.close()
