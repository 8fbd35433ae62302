"""Building and loading the project's C++ CPU extensions, on first use.

Each extension (the paged attention kernel, the quantized-weight products) is compiled the
first time it is needed, never at import of kvserve, into ``$KVSERVE_CACHE_DIR/ext``
(default ``~/.cache/kvserve/ext``) under a name keyed by a hash of its sources, the flags
and the torch / Python versions, so a changed source or another torch builds anew and old
builds are never loaded by mistake. Concurrent builders (two processes starting at once)
each compile in a private directory and atomically rename the library into place: no lock
that a killed build could leave behind.

The instruction set is chosen at run time, from /proc/cpuinfo (else torch's CPU
capability), widest first among those the extension offers; ``KVSERVE_CPU_ISA`` forces one
this CPU runs (tests build the narrower ones too). Shared headers live in kvserve/csrc/.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).parent
SHARED_HEADERS = ("csrc/simd.h",)           # relative to the package, on every include path
# hidden: two builds of one extension (two instruction sets) loaded in one process must not
# share inline functions or their static locals through the dynamic linker
BASE_FLAGS = ("-O3", "-DNDEBUG", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
_BUILD_ERRORS = (OSError, ImportError, RuntimeError, subprocess.SubprocessError)


@dataclass(frozen=True)
class CppExtension:
    """One extension. ``sources``: paths relative to the package, the first the .cpp that is
    compiled (the rest are its headers, hashed into the name). ``isas``: compiler flags per
    instruction set, widest first, ``scalar`` last; ``cpu_flags``: the /proc/cpuinfo flags each
    set needs. ``title`` and ``fallback`` make the one log line a failed build leaves."""

    prefix: str
    sources: tuple[str, ...]
    isas: Mapping[str, tuple[str, ...]]
    cpu_flags: Mapping[str, frozenset[str]]
    title: str
    fallback: str

    def __post_init__(self) -> None:
        if list(self.isas)[-1] != "scalar" or set(self.cpu_flags) != set(self.isas) - {"scalar"}:
            raise ValueError(f"{self.prefix}: isas must end with scalar and every other set needs cpu_flags")


def cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR/ext``, else ``$XDG_CACHE_HOME/kvserve/ext``, else ``~/.cache/kvserve/ext``."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser() / "ext"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve" / "ext"
    return Path.home() / ".cache" / "kvserve" / "ext"


def cpu_flags() -> set[str] | None:
    """The flags /proc/cpuinfo lists for this CPU, or None when there is no /proc."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def supported_isas(ext: CppExtension) -> list[str]:
    """The instruction sets of ``ext`` this CPU runs, widest first (``scalar`` always last)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["scalar"]
    flags = cpu_flags()
    if flags is None:   # no /proc: what torch detected, as the nearest of ours
        has = {"AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
               "AVX2": {"avx2", "fma", "f16c"}}.get(torch.backends.cpu.get_cpu_capability(), set())
        flags = has
    return [isa for isa, needs in ext.cpu_flags.items() if needs <= flags] + ["scalar"]


def detect_isa(ext: CppExtension) -> str:
    """The widest instruction set of ``ext`` this CPU runs, or ``KVSERVE_CPU_ISA`` when set
    (ValueError if this CPU cannot run it or ``ext`` has no such build)."""
    supported = supported_isas(ext)
    forced = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in supported:
            raise ValueError(f"KVSERVE_CPU_ISA={forced!r}: {ext.title} runs here as {', '.join(supported)}")
        return forced
    return supported[0]


def extension_name(ext: CppExtension, isa: str) -> str:
    """Module name of the build of ``ext`` for ``isa``: changes with the sources, flags, torch and Python."""
    h = hashlib.sha256()
    for name in (*ext.sources, *SHARED_HEADERS):
        h.update((PACKAGE_DIR / name).read_bytes())
    h.update(repr((BASE_FLAGS, ext.isas[isa], torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return f"{ext.prefix}_{isa}_{h.hexdigest()[:16]}"


def library_path(ext: CppExtension, isa: str) -> tuple[str, Path]:
    """The module name of ``ext``'s build for ``isa`` and where that library is cached."""
    name = extension_name(ext, isa)
    return name, cache_dir() / f"{name}.so"


def load(ext: CppExtension, isa: str | None = None) -> ModuleType | None:
    """The compiled module, building it if needed; None (after one log line saying why) when
    it cannot be built or loaded, so callers fall back to their torch path. Not cached: each
    extension's module keeps its own ``functools.cache`` around this."""
    isa = isa or detect_isa(ext)
    name, target = library_path(ext, isa)
    try:
        return _import(name, target) if target.is_file() else _build(ext, name, isa, target)
    except _BUILD_ERRORS as e:  # a compiler error, a missing compiler or header, a broken cached file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("kvserve: %s is unavailable (%s); %s", ext.title, reason, ext.fallback)
        return None


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(ext: CppExtension, name: str, isa: str, target: Path) -> ModuleType:
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
        module = cpp_extension.load(name, [str(PACKAGE_DIR / ext.sources[0])],
                                    extra_cflags=[*BASE_FLAGS, *ext.isas[isa]], extra_ldflags=["-fopenmp"],
                                    extra_include_paths=[str(PACKAGE_DIR / "csrc")],
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


@dataclass(frozen=True)
class Built:
    """One build of ``build_ahead``: ``status`` is ``cached`` (found), ``built`` or ``failed``
    (the runtime then falls back, as the extension's ``fallback`` says)."""

    title: str
    isa: str
    status: str
    seconds: float
    path: Path


def build_ahead(named: Sequence[str], every_isa: bool = False, jobs: int = 1) -> list[Built]:
    """Build now what would otherwise be built on first use: each extension named
    ``"package.module:ATTRIBUTE"``, for the widest instruction set this CPU runs (the one kvserve
    loads), or with ``every_isa`` for each set it runs (the tests build them all). Builds not
    yet cached run in ``jobs`` processes (a build is one compiler process). Named, not passed:
    an extension's MappingProxyType fields do not pickle to a worker."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    wanted = []             # (name given, extension, instruction set, cached library)
    for spec in named:
        ext = _named_extension(spec)
        isas = supported_isas(ext) if every_isa else [detect_isa(ext)]
        wanted += [(spec, ext, isa, library_path(ext, isa)[1]) for isa in isas]
    results = [Built(ext.title, isa, "cached", 0.0, target) if target.is_file() else None
               for spec, ext, isa, target in wanted]
    pending = [i for i, r in enumerate(results) if r is None]
    if pending:
        # spawn: a forked child would inherit this process's torch and OpenMP state
        with ProcessPoolExecutor(max_workers=min(jobs, len(pending)), mp_context=get_context("spawn")) as pool:
            futures = {i: pool.submit(_build_named, wanted[i][0], wanted[i][2]) for i in pending}
            for i, future in futures.items():
                ok, seconds = future.result()
                _, ext, isa, target = wanted[i]
                results[i] = Built(ext.title, isa, "built" if ok else "failed", seconds, target)
    return [r for r in results if r is not None]


def _named_extension(spec: str) -> CppExtension:
    module, _, attribute = spec.partition(":")
    ext = getattr(importlib.import_module(module), attribute, None)
    if not isinstance(ext, CppExtension):
        raise TypeError(f"{spec!r} names no CppExtension")
    return ext


def _build_named(spec: str, isa: str) -> tuple[bool, float]:
    start = time.perf_counter()
    ok = load(_named_extension(spec), isa) is not None
    return ok, time.perf_counter() - start
