"""Build the optional C core of the KV transport (``transport._kvio``).

Everything else is declared in pyproject.toml. The extension is optional: if it fails to build,
``transport`` falls back to its pure-Python twin (``transport._kvio_py``). Set
``PDR_REQUIRE_C_EXT=1`` (CI and wheels do) to make a failed build an error.
"""

import os

from setuptools import Extension, setup

required = os.environ.get("PDR_REQUIRE_C_EXT", "") == "1"

setup(
    ext_modules=[
        Extension(
            "transport._kvio",
            sources=["transport/_kvio.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
            optional=not required,
        )
    ],
)
