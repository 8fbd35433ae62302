"""The C++ CPU attention kernel (kvserve/attention/csrc/) as an extension built on first use; it
also holds the encoders that write new keys and values into every KV format (encode.h).

Building, caching and picking the instruction set are kvserve/extensions.py's; this names
the sources and the sets: AVX-512 (F/BW/VL/DQ, and VBMI when present) when this CPU has it,
else AVX2 + FMA + F16C, else a portable scalar build.
"""

from __future__ import annotations

import functools
from types import MappingProxyType, ModuleType

from kvserve.extensions import CppExtension, load
from kvserve.extensions import supported_isas as isas_of

_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX512_CPU = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
ATTENTION = CppExtension(
    prefix="kvserve_cpu_attention",
    sources=tuple(f"attention/csrc/{name}"
                  for name in ("paged_attention.cpp", "kernel.h", "attend.h", "dequant.h", "encode.h")),
    isas=MappingProxyType({
        "avx512vbmi": (*_AVX512, "-mavx512vbmi"),
        "avx512": _AVX512,
        "avx2": ("-mavx2", "-mfma", "-mf16c"),
        "scalar": (),
    }),
    cpu_flags=MappingProxyType({
        "avx512vbmi": _AVX512_CPU | {"avx512vbmi"},
        "avx512": _AVX512_CPU,
        "avx2": frozenset({"avx2", "fma", "f16c"}),
    }),
    title="the C++ CPU attention kernel",
    fallback="using the torch attention backend",
)


def supported_isas() -> list[str]:
    """The attention kernel's instruction sets this CPU runs, widest first (``scalar`` last)."""
    return isas_of(ATTENTION)


@functools.cache
def load_extension(isa: str | None = None) -> ModuleType | None:
    """The compiled kernel module (``isa``: None for the widest this CPU runs), or None after
    one log line saying why it cannot be built, so callers use the torch backend."""
    return load(ATTENTION, isa)
