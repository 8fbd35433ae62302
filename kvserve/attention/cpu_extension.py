"""Building and loading the C++ CPU attention kernel (kvserve/attention/csrc/).

The extension is compiled on first use, never at import of kvserve, into
``$KVSERVE_CACHE_DIR/ext`` (default ``~/.cache/kvserve/ext``) under a name keyed by a hash of
the sources, the flags and the torch / Python versions, so a changed source or another torch
builds anew and old builds are never loaded by mistake. Concurrent builders (two processes
starting at once) each compile in a private directory and atomically rename the library
into place: no lock that a killed build could leave behind.

The instruction set is chosen at run time, from /proc/cpuinfo (else torch's CPU capability):
AVX-512 (F/BW/VL/DQ, and VBMI when present) when this CPU has it, else AVX2 + FMA + F16C,
else a portable scalar build. ``KVSERVE_CPU_ISA`` forces one this CPU runs (tests build the
narrower ones too).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.cpp", "kernel.h", "attend.h", "dequant.h", "simd.h")
BASE_FLAGS = ("-O3", "-DNDEBUG", "-fopenmp")
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
ISA_FLAGS = {
    "avx512vbmi": (*_AVX512, "-mavx512vbmi"),
    "avx512": _AVX512,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "scalar": (),
}
_ISA_CPU_FLAGS = {  # widest first
    "avx512vbmi": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2": {"avx2", "fma", "f16c"},
}
_BUILD_ERRORS = (OSError, ImportError, RuntimeError, subprocess.SubprocessError)


def cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR/ext``, else ``$XDG_CACHE_HOME/kvserve/ext``, else ``~/.cache/kvserve/ext``."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser() / "ext"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve" / "ext"
    return Path.home() / ".cache" / "kvserve" / "ext"


def detect_isa() -> str:
    """The widest instruction set in ISA_FLAGS this CPU runs, or ``KVSERVE_CPU_ISA`` when set
    (ValueError if this CPU cannot run it)."""
    supported = supported_isas()
    forced = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in supported:
            raise ValueError(f"KVSERVE_CPU_ISA={forced!r}: this CPU runs {', '.join(supported)}")
        return forced
    return supported[0]


def supported_isas() -> list[str]:
    """The instruction sets of ISA_FLAGS this CPU runs, widest first (``scalar`` always last)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["scalar"]
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # no /proc: what torch detected
        widest = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "scalar")
        return list(ISA_FLAGS)[list(ISA_FLAGS).index(widest):]
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [isa for isa, needs in _ISA_CPU_FLAGS.items() if needs <= flags] + ["scalar"]


def extension_name(isa: str) -> str:
    """Module name of the build for ``isa``: changes with the sources, flags, torch and Python."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(repr((BASE_FLAGS, ISA_FLAGS[isa], torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return f"kvserve_cpu_attention_{isa}_{h.hexdigest()[:16]}"


@functools.cache
def load_extension(isa: str | None = None) -> ModuleType | None:
    """The compiled kernel module, building it if needed; None (after one log line saying
    why) when it cannot be built or loaded, so callers fall back to the torch backend."""
    isa = isa or detect_isa()
    name = extension_name(isa)
    target = cache_dir() / f"{name}.so"
    try:
        return _import(name, target) if target.is_file() else _build(name, isa, target)
    except _BUILD_ERRORS as e:  # a compiler error, a missing compiler or header, a broken cached file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("kvserve: the C++ CPU attention kernel is unavailable (%s); using the torch attention backend",
                    reason)
        return None


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, isa: str, target: Path) -> ModuleType:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=target.parent))
    log_path = target.parent / f"{name}.log"
    path = os.environ.get("PATH", "")
    # ninja may be installed next to this Python (a virtual environment not activated)
    os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.path.dirname(sys.executable), path])
    try:
        module = cpp_extension.load(name, [str(SOURCE_DIR / "paged_attention.cpp")],
                                    extra_cflags=[*BASE_FLAGS, *ISA_FLAGS[isa]], extra_ldflags=["-fopenmp"],
                                    build_directory=str(work), verbose=False)
        os.replace(work / f"{name}.so", target)   # atomic: a concurrent builder's rename is as good
        return module
    except _BUILD_ERRORS as e:
        log_path.write_text(str(e))
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if "error" in line.lower() and len(line) < 300), type(e).__name__)
        raise RuntimeError(f"building {name} failed: {first} (full output in {log_path})") from e
    finally:
        os.environ["PATH"] = path
        shutil.rmtree(work, ignore_errors=True)
