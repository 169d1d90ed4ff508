"""The compiled fast paths (ocxproxy/_speedups.c): optional, so that an install on a
machine without a C compiler still works, on the pure-Python code (ocxproxy/speedups.py)."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "ocxproxy/_speedups.c"
# What the module was built from: ocxproxy/speedups.py does not load a build older than
# the source next to it (a checkout whose C changed since its last build).
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "ocxproxy._speedups",
            [SOURCE],
            define_macros=[("SOURCE_DIGEST", f'"{DIGEST}"')],
            optional=True,
        )
    ]
)
