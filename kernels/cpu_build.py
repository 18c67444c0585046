"""Build-at-first-use for the plain-C CPU kernels, loaded with ctypes.

The system C compiler (`$CC`, else `cc`) builds `kernels/<name>.c` into a cache
directory (`$RAYLLM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/rayllm/kernels`, else
`~/.cache/rayllm/kernels`) under a name keyed by the source, the kernels/*.c files it includes
whole (kernels/cpu_decoder_layer.c) and kernels/*.h, the flags, the
compiler and this CPU's feature flags (the build uses -march=native, so a
cache shared between different machines must not hand one's binary to the
other). Builds are atomic: compile to a temporary file, then rename, so
concurrent processes never load a half-written library.

No torch C++ headers: a plain C build takes well under a second, where a torch
extension takes minutes. `RAYLLM_DISABLE_CPU_KERNEL=1` skips the build, and any
build failure leaves the caller on its torch path after one warning.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

DISABLE_ENV = "RAYLLM_DISABLE_CPU_KERNEL"
CACHE_ENV = "RAYLLM_KERNEL_CACHE"
# OpenMP first; a compiler without libgomp still gets a single-threaded kernel.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-shared", "-fPIC"],
)


def kernel_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rayllm" / "kernels"


def _cpu_signature() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them ("avx512_bf16", "amx_bf16", ...); empty
    where there is no such file."""
    return frozenset(_cpu_signature().partition(":")[2].split())


def _compile(cc: str, source: Path, target: Path, flags: list[str]) -> str | None:
    """Compile into a temp file next to `target`, then rename; returns the error text or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-I", str(source.parent), "-o", tmp, str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return proc.stderr.strip()[-2000:] or f"{cc} exited with {proc.returncode}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _included_sources(source: Path) -> list[bytes]:
    """The bytes of the kernels/*.c files `source` includes whole (cpu_decoder_layer.c): part of its key."""
    names = re.findall(rb'^#include "([A-Za-z0-9_]+\.c)"', source.read_bytes(), flags=re.M)
    return [source.with_name(n.decode()).read_bytes() for n in names]


def _build(name: str) -> Path:
    """The cached shared library for kernels/<name>.c, compiled if missing; raises RuntimeError."""
    source = Path(__file__).with_name(name + ".c")
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH")
    errors = []
    for flags in _FLAG_SETS:
        headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
        key = hashlib.sha256(b"\0".join(
            [source.read_bytes(), *headers, *_included_sources(source), " ".join(flags).encode(), cc.encode(),
             _cpu_signature().encode()])).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        if target.exists():
            return target
        error = _compile(cc, source, target, flags)
        if error is None:
            return target
        errors.append(f"{' '.join(flags)}: {error}")
    raise RuntimeError("; ".join(errors))


@functools.lru_cache(maxsize=None)
def load_kernel_library(name: str) -> ctypes.CDLL | None:
    """kernels/<name>.c as a loaded library, or None (disabled, or the build failed: one warning).

    torch must be imported first: the library then binds to the OpenMP runtime torch
    already loaded (same soname), so the two share one thread pool instead of fighting.
    """
    if kernel_disabled():
        return None
    try:
        return ctypes.CDLL(str(_build(name)))
    except (RuntimeError, OSError) as exc:
        warnings.warn(f"CPU kernel {name!r} unavailable, using the torch path instead: {exc}",
                      RuntimeWarning, stacklevel=2)
        return None


def bind_signatures(lib: ctypes.CDLL | None, signatures: dict) -> ctypes.CDLL | None:
    """`lib` with each function's ctypes types set from {name: (argtypes, restype)}; None stays None."""
    if lib is not None:
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib
