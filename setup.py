"""Build the compiled twins: every ``*.pyx`` under ``pdcore/`` and ``transport/``, and the
pure-Python-mode sources in ``PURE_MODE``, compiled as they are under another module name.

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

#: source -> compiled module; the source stays importable as Python (the pure twin).
PURE_MODE = {"pdcore/core/_events_py.py": "pdcore.core._events", "pdcore/epd/_types_py.py": "pdcore.epd._types"}

sources = {str(pyx.with_suffix("")).replace(os.sep, "."): str(pyx)
           for package in ("pdcore", "transport") for pyx in sorted(Path(package).rglob("*.pyx"))}
sources.update({name: source for source, name in PURE_MODE.items()})
extensions = [
    Extension(name, [source], include_dirs=[numpy.get_include()], extra_compile_args=cflags, define_macros=macros)
    for name, source in sources.items()
]

JOBS = os.cpu_count() or 1  # the modules are independent: translate and compile them side by side
print(f"pdcore: {'debug' if DEBUG else 'quick' if QUICK else 'optimised'} build of {len(extensions)} compiled modules, {JOBS} at a time")
setup(ext_modules=cythonize(extensions, compiler_directives=directives, nthreads=JOBS),
      options={"build_ext": {"parallel": JOBS}})
