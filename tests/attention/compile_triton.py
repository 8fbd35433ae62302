"""Compile the Triton attention kernel for a CUDA architecture on a machine without a GPU
(Triton ships ptxas) and print each variant's registers, spill stack and shared memory.

    python tests/attention/compile_triton.py [--arch 90] [--variants kivi2:bf16:128:decode ...]

A variant is ``format:dtype:head_dim:mode`` (format as ``kivi2``, ``k=int8,v=kivi2`` or, for a
zip storage's mixed blocks, ``zip=int8/kivi2``: finer / base; mode ``decode``, ``prefill``,
``split``: a decode whose contexts are cut in splits of 256 keys, merged by each tile's last
program, or ``score``: the scoring kernel after a decode); the arguments are those ``paged_attention``
launches with (the default launch config, strides of a real cache, 16-byte alignment as the
runtime specializes them). Besides registers and spills, each line gives the shared memory the
kernel asks (``smem``: an H100 or H200 has 227 KB). Run without TRITON_INTERPRET: the
interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]     # this checkout's kvserve, and tests/attention/cases.py

from attention.cases import make_case

from kvserve.attention import triton_jit, triton_kernels
from kvserve.kv.storage.layout import AttentionScores, RefinedHalf

DEFAULT_VARIANTS = ["native:bf16:128:decode", "native:bf16:128:split", "int8:bf16:128:decode", "fp8:bf16:128:decode",
                    "kivi2:bf16:128:decode", "int4:fp16:64:decode", "int8+had+out4:bf16:128:decode",
                    "kivi2:bf16:128:prefill", "fp32:fp32:64:decode", "zip=int8/kivi2:bf16:128:decode",
                    "zip=int8/kivi2:bf16:128:prefill", "kivi2:bf16:128:score", "zip=int8/kivi2:bf16:64:score"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compile_variant(variant: str, arch: int) -> str:
    """ptxas resource usage of one variant, e.g. ``REG:168 STACK:0 SHARED:1024``."""
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]
    from triton.runtime.jit import mangle_type  # type: ignore[import-untyped]

    fmt, dtype, head_dim, mode = variant.rsplit(":", 3)
    fine = None
    if fmt.startswith("zip="):
        fine, fmt = fmt[len("zip="):].split("/")
    halves = dict(h.split("=") for h in fmt.split(",")) if "=" in fmt else {"k": fmt, "v": fmt}
    queries = [1, 40, 9, 64] if mode == "prefill" else [1, 1, 1, 1]
    shape = {"lens": [300, 800, 999, 1000], "num_queries": queries, "num_kv_heads": 8, "group": 4,
             "head_dim": int(head_dim), "block_size": 16, "dtype": DTYPES[dtype]}
    case = make_case(halves["k"], halves["v"], **shape)
    key, value = case.key, case.value
    if fine is not None:    # the finer copies: another case's parts, one side map
        finer = make_case(fine, **shape)
        side_map = torch.zeros(next(iter(key.parts.values())).shape[0], dtype=torch.int64)
        key = replace(key, refined=RefinedHalf(finer.key.layout, finer.key.parts, side_map))
        value = replace(value, refined=RefinedHalf(finer.value.layout, finer.value.parts, side_map))
    cfg = triton_kernels.launch_config(case.q, case.batch, 8, tokens_per_split=256 if mode == "split" else None)
    stats = torch.empty(2, case.q.shape[0] * case.q.shape[1]) if mode == "score" else None
    halves = triton_kernels.prepare(key, value, int(head_dim), case.batch.block_size)
    plan = triton_kernels.Launcher().plan(case.q, case.batch, 8, cfg, f32_dots=arch < 80)
    launch = triton_kernels.attend_launch(case.q, halves, plan, case.scale, torch.empty_like(case.q), stats=stats)
    kernel = triton_jit.attend
    if mode == "score":
        assert stats is not None
        scores = AttentionScores(torch.empty(4, 8, 1000), torch.zeros(4, dtype=torch.int32))
        grid, args, constants = triton_kernels.score_launch(case.q, halves, plan, case.scale, scores, stats)
        launch = triton_kernels.AttendLaunch(grid, args, constants)
        kernel = triton_jit.score
    names = [n for n in kernel.arg_names if n not in launch.constants]
    signature = {n: mangle_type(a) for n, a in zip(names, launch.args)}
    signature.update({n: "constexpr" for n in launch.constants})
    aligned = [n for n, a in zip(names, launch.args)
               if isinstance(a, torch.Tensor) or (isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0)]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, signature, constexprs=launch.constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    line = next(x for x in usage.splitlines() if "REG:" in x)
    return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "SHARED")) + \
        f" smem:{compiled.metadata.shared} (warps {cfg.num_warps}, rows {cfg.rows}, block_n {cfg.block_n})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: A100, 90: H100)")
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for variant in args.variants:
        print(f"sm_{args.arch} {variant}: {compile_variant(variant, args.arch)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
