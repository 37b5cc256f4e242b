"""Build the compiled twins: every ``*.pyx`` under ``pdcore/`` and ``transport/``.

``PDCORE_DEBUG_BUILD=1`` turns on Cython bounds checks and line tracing and
builds with ``-O0 -g``. ``PDCORE_QUICK_BUILD=1`` builds the same code at
``-O0`` (several times faster to compile: the mutant runs rebuild a patched
module for each planted bug). Compiler warnings fail the build either way.
"""

import os
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PDCORE_DEBUG_BUILD") == "1"

directives = {
    "language_level": 3,
    "embedsignature": True,
    "boundscheck": DEBUG,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": DEBUG,
    "linetrace": DEBUG,
}
QUICK = os.environ.get("PDCORE_QUICK_BUILD") == "1"
cflags = ["-O0", "-g3", "-UNDEBUG"] if DEBUG else ["-O0", "-DNDEBUG"] if QUICK else ["-O3", "-DNDEBUG"]
cflags += ["-Wall", "-Werror", "-Wno-unused-function", "-Wno-unreachable-code"]
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    macros.append(("CYTHON_TRACE_NOGIL", "1"))

extensions = [
    Extension(
        str(pyx.with_suffix("")).replace(os.sep, "."),
        [str(pyx)],
        include_dirs=[numpy.get_include()],
        extra_compile_args=cflags,
        define_macros=macros,
    )
    for package in ("pdcore", "transport")
    for pyx in sorted(Path(package).rglob("*.pyx"))
]

print(f"pdcore: {'debug' if DEBUG else 'quick' if QUICK else 'optimised'} build of {len(extensions)} compiled modules")
setup(ext_modules=cythonize(extensions, compiler_directives=directives))
