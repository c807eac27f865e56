"""Shared fixtures: the tiny model (built once, cached) and an in-process router on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import pytest

from launch.local import free_port  # noqa: F401  (ports outside the ephemeral range)


@pytest.fixture(scope="session")
def tiny_model_path():
    from launch.tiny_model import ensure_tiny_model
    from router.tokenizer import _load

    path = ensure_tiny_model()
    _load(str(path))  # warm the process-wide tokenizer cache: the first load can take seconds
    return path


@contextlib.asynccontextmanager
async def run_router(settings, **overrides):
    """Serve create_app(settings) with uvicorn on a free port; yield (base_url, app)."""
    from router.app import create_app
    from router.server import RouterServer, uvicorn_config

    settings = settings.replace(port=free_port(), host="127.0.0.1")
    app = create_app(settings, **overrides)
    # the same server the CLI runs (router/server.py: hot endpoints below ASGI; keep-alive 75 s,
    # not uvicorn's 5 s default that a loaded test machine can race with a pooled client)
    config = uvicorn_config(app, settings, lifespan="on", timeout_graceful_shutdown=2)
    server = RouterServer(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    else:
        raise RuntimeError("router did not start")
    try:
        yield f"http://{settings.host}:{settings.port}", app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
