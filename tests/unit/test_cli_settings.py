"""CLI flags and PD_ROUTER_* variables map onto one frozen Settings object."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from router.cli import build_parser, settings_from_args


def settings(argv, env=None):
    args = build_parser().parse_args(["serve", *argv])
    return settings_from_args(args, env or {})


def test_flags_map_onto_settings():
    s = settings(["--mode", "pull", "--threshold", "4096", "--prefill", "http://10.0.0.1:8100",
                  "--prefill", "10.0.0.2:8100", "--decode", "http://10.0.0.3:8200/", "--port", "9000",
                  "--tokenizer", "/models/x", "--idle-timeout", "0"])
    assert s.mode == "pull" and s.threshold == 4096 and s.port == 9000 and s.tokenizer == "/models/x"
    assert [p.url for p in s.prefill] == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    assert [d.url for d in s.decode] == ["http://10.0.0.3:8200"]
    assert s.idle_timeout is None


def test_environment_variables_and_precedence():
    env = {"PD_ROUTER_THRESHOLD": "100", "PD_ROUTER_MODE": "pull", "PD_ROUTER_DECODE": "http://a:1,http://b:2",
           "PD_ROUTER_FORWARD_AUTHORIZATION": "true"}
    s = settings([], env)
    assert s.threshold == 100 and [d.url for d in s.decode] == ["http://a:1", "http://b:2"]
    assert s.forward_authorization is True
    assert settings(["--threshold", "7"], env).threshold == 7  # the flag wins


@pytest.mark.parametrize("argv,env,msg", [
    (["--mode", "push", "--prefill", "http://p:1"], {}, "engine_id"),
    ([], {"PD_ROUTER_MODE": "sideways"}, "must be one of"),
    ([], {"PD_ROUTER_THRESHOLD": "lots"}, "PD_ROUTER_THRESHOLD"),
    (["--threshold", "-1"], {}, "threshold"),
    (["--prefill", "http://p:1?color=red"], {}, None),
])
def test_bad_configuration_fails_clearly(argv, env, msg):
    with pytest.raises(SystemExit) as exc:
        settings(argv, env)
    if msg:
        assert msg in str(exc.value)


def test_push_mode_is_accepted_with_coordinates():
    s = settings(["--mode", "push", "--threshold", "4096", "--prefill",
                  "http://10.0.0.1:8100?engine_id=prefill-0&kv_host=10.0.0.1&kv_port=5600&tp=1&pp=1"])
    assert s.mode == "push" and s.prefill[0].engine_id == "prefill-0"


def test_router_process_never_imports_torch(tiny_model_path):
    """The serving process blocks torch before transformers loads (see tokenizer.block_torch)."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        from router.tokenizer import block_torch, TokenCounter
        block_torch()
        import router.app, router.cli
        async def main():
            tc = TokenCounter({str(tiny_model_path)!r})
            n = await tc.count("chat", {{"messages": [{{"role": "user", "content": "hello there"}}]}})
            assert n > 3, n
            tc.close()
        asyncio.run(main())
        assert sys.modules.get("torch") is None, "torch was imported"
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_imports_resolve_to_this_distribution():
    import launch
    import router

    for mod in (router, launch):
        assert "site-packages/router" not in mod.__file__ and "site-packages/launch" not in mod.__file__
    from pathlib import Path
    root = Path(router.__file__).resolve().parents[1]
    assert (root / "pyproject.toml").exists() and 'name = "pd-router"' in (root / "pyproject.toml").read_text()


def test_serve_refuses_a_tokenizer_path_that_does_not_exist(tmp_path, capsys):
    """`serve --tokenizer <missing path>` exits at once with the reason, before it listens."""
    from router import cli
    from router.tokenizer import local_path_problem

    missing = tmp_path / "nope"
    assert cli.main(["serve", "--tokenizer", str(missing), "--decode", "http://127.0.0.1:9"]) == 2
    assert f"--tokenizer {missing}: no such file or directory" in capsys.readouterr().err
    a_file = tmp_path / "tokenizer.json"
    a_file.write_text("{}")
    assert "not a directory" in local_path_problem(str(a_file))
    assert local_path_problem(str(tmp_path)) is None  # exists: loading decides the rest
    assert local_path_problem("Qwen/Qwen2.5-0.5B") is None  # a hub name: resolved from the cache
    assert local_path_problem(None) is None
    assert "no such file" in local_path_problem("~/surely-not-a-model-dir-pdr")
