"""Build the optional C parts: the KV transport's core (``transport._kvio``) and the router's
per-read stream relay (``router._splice``).

Everything else is declared in pyproject.toml. Both are optional: if one fails to build,
``transport`` falls back to its pure-Python twin (``transport._kvio_py``) and the router relays
every read in Python (router/relay.py). Set ``PDR_REQUIRE_C_EXT=1`` (CI and wheels do) to make a
failed build an error.
"""

import os

from setuptools import Extension, setup

required = os.environ.get("PDR_REQUIRE_C_EXT", "") == "1"

FLAGS = ["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension("transport._kvio", sources=["transport/_kvio.c"], extra_compile_args=FLAGS, optional=not required),
        Extension("router._splice", sources=["router/_splice.c"], extra_compile_args=FLAGS, optional=not required),
    ],
)
