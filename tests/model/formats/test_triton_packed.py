"""The Triton products of packed weights against the float reference, in every kind.

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter: the
module is imported with TRITON_INTERPRET=1 (restored afterwards, so no other test module
sees it), and matrices stay at 40 x 256 or so (the interpreter runs each program's ops
through numpy, one program at a time).

Tolerances. float32: the kernel dequantizes with the reference's float steps and sums the
K products in float32 in another order (tiles, splits) than the float64 reference; the
error bound is about K x 2^-24 x sum |x| |w| (1.5e-5 of it for K = 256), observed errors
stay below 2e-7 of it, so the tolerance is 1e-5 of ``sum |x| |w|`` (the largest over the
output). A misread code or scale moves an output by about |x_k| x scale, 1e-3 of it and
more. float16 / bfloat16: both sides multiply the same rounded operands; the kernel rounds
the output once to the dtype (half an ulp: 2^-11 / 2^-8 relative; the tolerance is twice
that). The interpreter's own casts to bfloat16 truncate: the kernel rounds to nearest by
integer arithmetic there, so these bounds hold on the interpreter as on a GPU.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from blocks import random_packed

from kvserve.model.formats.packing import (
    Outliers,
    PackedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
    stack,
)
from kvserve.model.linear import DenseProduct, TorchLinear, rms_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODULE = "kvserve.model.formats.triton"
TOL = 1e-5
ROWS = 40          # not a multiple of 16 (a tile) nor of 32 (a program's columns)
BATCHES = (1, 2, 7, 16, 33)


def _load_kernels() -> ModuleType:
    """kvserve.model.formats.triton, its kernels decorated for the interpreter when there is no
    GPU. Triton decorates its own library functions when it is first imported, so the
    variable must be set before then too (checked after the import)."""
    if DEVICE.type == "cuda":
        pytest.importorskip("triton")
        return importlib.import_module(MODULE)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        importlib.import_module("triton.experimental.gluon")   # imported lazily at the first launch
        module = importlib.import_module(MODULE)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    library = sys.modules["triton.language.standard"].cdiv
    if not module.is_interpreted() or type(library).__name__ != "InterpretedFunction":
        raise RuntimeError("triton or kvserve.model.formats.triton was imported before TRITON_INTERPRET=1 was set")
    return module


qt = _load_kernels()


@pytest.fixture(scope="module", autouse=True)
def single_threaded_cpu() -> Iterator[None]:
    """The interpreter runs numpy ops of a few KB one after another: torch's threads spinning
    between them on 2 busy cores cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- weights --------------------------------------------------------------------------------

def gguf_weight(type_name: str, rows: int, cols: int, seed: int) -> PackedWeight:
    """Random blocks of ``type_name`` (every code and sub-scale byte random) with small fp16 scales."""
    return random_packed(type_name, rows, cols, seed)


def float_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1


# name -> maker; Q4_0 and Q5_0 at K = 160 and int4-g96 read K in steps of 32, the others of 64
WEIGHTS = {
    "Q4_0": lambda: gguf_weight("Q4_0", ROWS, 160, 1),
    "Q4_1": lambda: gguf_weight("Q4_1", ROWS, 256, 2),
    "Q8_0": lambda: gguf_weight("Q8_0", ROWS, 256, 3),
    "Q4_K": lambda: gguf_weight("Q4_K", ROWS, 256, 4),
    "Q6_K": lambda: gguf_weight("Q6_K", ROWS, 256, 5),
    "Q5_0": lambda: gguf_weight("Q5_0", ROWS, 160, 13),
    "Q5_1": lambda: gguf_weight("Q5_1", ROWS, 256, 14),
    "Q5_K": lambda: gguf_weight("Q5_K", ROWS, 256, 15),
    "int8-g32": lambda: quantize_int8(float_weight(ROWS, 256, 6), 32),
    "int8-g64": lambda: quantize_int8(float_weight(ROWS, 256, 7), 64),
    "int8-row": lambda: quantize_int8(float_weight(ROWS, 256, 8), 256),
    "int4-g32": lambda: quantize_int4(float_weight(ROWS, 256, 9), 32),
    "int4-g64": lambda: quantize_int4(float_weight(ROWS, 256, 10), 64),
    "int4-row": lambda: quantize_int4(float_weight(ROWS, 256, 11), 256),
    "int4-g96": lambda: quantize_int4(float_weight(ROWS, 192, 12), 96),
}


def stacked() -> PackedWeight:
    """Three segments of three kinds sharing K = 256 (rows 40, 24, 8: Q, K, V), with a bias."""
    parts = [gguf_weight("Q4_K", 40, 256, 20), quantize_int4(float_weight(24, 256, 21), 32),
             gguf_weight("Q6_K", 8, 256, 22)]
    return stack(parts, torch.randn(72, generator=torch.Generator().manual_seed(23)))


def activations(num_rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


def product(packed: PackedWeight, dtype: torch.dtype = torch.float32, **kwargs) -> qt.TritonPackedProduct:
    return qt.TritonPackedProduct(packed, DEVICE, dtype, **kwargs)


def check(out: torch.Tensor, x: torch.Tensor, packed: PackedWeight, residual: torch.Tensor | None = None) -> None:
    """``out`` = residual + x W^T + bias within TOL of sum |x| |w| (float64 reference)."""
    w = dequantize(packed).double().to(DEVICE)
    ref = x.double() @ w.T
    if packed.bias is not None:
        ref = ref + packed.bias.double().to(DEVICE)
    if residual is not None:
        ref = ref + residual.double()
    scale = (x.double().abs() @ w.abs().T).max().item()
    assert out.shape == ref.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL * scale, rtol=0)


# ---- products -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", WEIGHTS)
def test_every_kind_and_batch_size_against_the_reference(name: str) -> None:
    packed = WEIGHTS[name]()
    p = product(packed)
    assert (p.rows, p.cols) == packed.shape and p.nbytes == packed.nbytes
    for num_rows in BATCHES:
        x = activations(num_rows, packed.cols, num_rows)
        check(p(x), x, packed)


def _numpy_dots_ignore_the_batch() -> bool:
    """Whether this host's numpy (the interpreter's ``tl.dot``) gives a row the same bits in a
    16-row product as in a 64-row one, and alone in a 64-row tile of zeros as among others: not
    so with OpenBLAS's Haswell kernels (seen 2026-11-28 on an AMD EPYC without AVX-512, numpy
    2.4.6, OpenBLAS 0.3.31), so there the interpreter cannot show batch invariance."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g).numpy(), torch.randn(256, 64, generator=g).numpy()
    whole = a @ b
    alone = a.copy()
    alone[1:] = 0
    return bool((whole[:16] == a[:16] @ b).all() and (whole[:1] == a[:1] @ b).all()
                and (whole[0] == (alone @ b)[0]).all())


def _skip_where_numpy_sees_the_batch() -> None:
    if DEVICE.type == "cpu" and not _numpy_dots_ignore_the_batch():
        pytest.skip("this host's numpy matmul (the interpreter's tl.dot) sums a row otherwise in another "
                    "batch; the GPU's MMA is what the kernel's batch invariance is about")


@pytest.mark.parametrize("one_tile", [False, True], ids=["two-tiles", "one-tile"])
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "int8-g32", "int4-g96"])
def test_a_rows_result_does_not_depend_on_its_batch(name: str, one_tile: bool) -> None:
    """Exactly equal: a row alone, among 7 or 16, or among 33. With two tiles (before sm_90) a
    row alone runs in a 16-row tile and among 33 in a 64-row one: equal where both take the same
    MMA instruction (sm_80: mma.sync; the interpreter: numpy's float32 matmul, on a host whose
    numpy sums a row alike in both). With one tile (sm_90, and forced on the interpreter) every
    row count runs in 64-row tiles (the module doc of kvserve.model.formats.triton)."""
    _skip_where_numpy_sees_the_batch()
    packed = WEIGHTS[name]()
    p = product(packed)
    if DEVICE.type == "cpu":
        for seg in p.segments:
            seg.one_tile = one_tile
    elif one_tile != p.segments[0].one_tile:
        pytest.skip(f"this GPU runs {'one tile' if p.segments[0].one_tile else 'two tiles'}")
    x = activations(33, packed.cols, 0)
    batch = p(x)
    for i in (0, 6, 15, 32):
        assert torch.equal(p(x[i:i + 1])[0], batch[i])
    assert torch.equal(p(x[:7]), batch[:7])
    assert torch.equal(p(x[16:32]), batch[16:32])


def test_one_tile_runs_every_row_count_in_64_row_tiles() -> None:
    """``one_tile`` (sm_90's launches): a decode step's rows take the prefill's tile, so a row's
    sums come from one MMA instruction whatever its batch."""
    seg = WEIGHTS["Q4_1"]().segments[0]
    for one_tile, want in ((False, [16, 16, 64]), (True, [64, 64, 64])):
        launcher = qt.SegmentLaunch(seg, 0, qt.LaunchConfig(32, 256), torch.float32, False, one_tile=one_tile)
        got = []
        for num_rows in (1, 16, 17):
            x, out = torch.empty(num_rows, seg.cols), torch.empty(num_rows, seg.rows)
            got.append(launcher.matmul(x, out, out, None, None, False).constants["BLOCK_M"])
        assert got == want


def test_split_k_sums_in_order() -> None:
    """Splits of 64 columns (4 partial sums per output, added by _reduce): the reference, with a
    bias and outliers in the epilogue (batch invariance through the reduction: below)."""
    base = WEIGHTS["Q4_K"]()
    packed = replace(base, bias=torch.randn(ROWS), outliers=Outliers(torch.tensor([5, 70], dtype=torch.int32),
                                                                     torch.randn(ROWS, 2)))
    p = product(packed, config=qt.LaunchConfig(block_n=16, k_per_split=64))
    assert [s.num_splits for s in p.segments] == [4]
    x = activations(33, 256, 1)
    out = p(x)
    check(out, x, packed)
    residual = activations(33, ROWS, 2)
    check(p.add_into(residual.clone(), x), x, packed, residual)


def test_split_k_rows_do_not_depend_on_their_batch() -> None:
    _skip_where_numpy_sees_the_batch()
    p = product(WEIGHTS["Q4_K"](), config=qt.LaunchConfig(block_n=16, k_per_split=64))
    x = activations(33, 256, 1)
    assert torch.equal(p(x[3:4])[0], p(x)[3])


def test_stacked_segments_write_their_columns() -> None:
    packed = stacked()
    p = product(packed)
    assert [(s.col0, s.rows) for s in p.segments] == [(0, 40), (40, 24), (64, 8)]
    for num_rows in (1, 7, 33):
        x = activations(num_rows, 256, num_rows)
        check(p(x), x, packed)


@pytest.mark.parametrize("name", ["Q8_0", "int4-g32"])
def test_bias_and_outlier_channels(name: str) -> None:
    """Outlier channels: x zeroed there for the packed product, x[:, channels] @ weight^T added
    (dequantize puts those columns back: the reference sees the float values)."""
    base = WEIGHTS[name]()
    g = torch.Generator().manual_seed(3)
    outliers = Outliers(torch.tensor([0, 31, 32, 200], dtype=torch.int32), torch.randn(ROWS, 4, generator=g))
    for packed in (replace(base, bias=torch.randn(ROWS, generator=g)), replace(base, outliers=outliers),
                   replace(base, bias=torch.randn(ROWS, generator=g), outliers=outliers)):
        p = product(packed)
        for num_rows in (2, 33):
            x = activations(num_rows, 256, num_rows)
            x[:, 31] *= 50.0                     # an outlier channel worth its name
            check(p(x), x, packed)


def test_fused_forms_are_their_torch_compositions() -> None:
    """add_into and swiglu_add_into update the residual in place and return it."""
    packed = stacked()
    p = product(packed)
    g = torch.Generator().manual_seed(4)
    x = activations(7, 256, 5)
    norm = (1.0 + 0.1 * torch.randn(256, generator=g)).to(DEVICE)
    check(p.after_norm(x, norm, 1e-5), rms_norm(x, norm, 1e-5), packed)
    residual = activations(7, 72, 6)
    into = residual.clone()
    assert p.add_into(into, x) is into
    check(into, x, packed, residual)
    gate_up = activations(7, 512, 7)
    into = residual.clone()
    assert p.swiglu_add_into(into, gate_up) is into
    gate, up = gate_up.chunk(2, dim=-1)
    check(into, F.silu(gate) * up, packed, residual)
    assert torch.equal(p.head(x), p(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["Q4_K", "int4-g32"])
def test_half_precision(name: str, dtype: torch.dtype) -> None:
    """The weights rounded to the compute dtype for the dot, as the native format's are; the
    residual added in float32 before the one rounding of the output."""
    packed = WEIGHTS[name]()
    p = product(packed, dtype)
    w = dequantize(packed).to(DEVICE).to(dtype).double()
    rtol = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    for num_rows in (1, 33):
        x = activations(num_rows, 256, num_rows, dtype)
        residual = activations(num_rows, ROWS, 50 + num_rows, dtype)
        ref = x.double() @ w.T
        scale = (x.double().abs() @ w.abs().T).max().item()
        out = p(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=TOL * scale, rtol=rtol)
        torch.testing.assert_close(p.add_into(residual.clone(), x).double(), ref + residual.double(),
                                   atol=TOL * scale, rtol=rtol)


# ---- embedding ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", WEIGHTS)
def test_embedding_rows_are_the_dequantized_rows(name: str) -> None:
    packed = WEIGHTS[name]()
    embedding = qt.TritonKernel(DEVICE, torch.float32).embedding(product(packed))
    ids = torch.tensor([0, 39, 17, 17, 5, 16, 15, 32], device=DEVICE)
    assert torch.equal(embedding(ids), dequantize(packed).to(DEVICE)[ids])
    assert torch.equal(embedding(ids[2:3]), dequantize(packed).to(DEVICE)[ids[2:3]])


def test_embedding_of_segments_and_outliers_in_the_compute_dtype() -> None:
    packed = stacked()
    ids = torch.tensor([71, 0, 40, 39, 63, 64, 12], device=DEVICE)
    assert torch.equal(qt.TritonPackedEmbedding(product(packed))(ids), dequantize(packed).to(DEVICE)[ids])
    base = WEIGHTS["int8-g32"]()
    packed = replace(base, outliers=Outliers(torch.tensor([3, 100], dtype=torch.int32), torch.randn(ROWS, 2)))
    ids = torch.tensor([0, 39, 12, 17, 3], device=DEVICE)
    rows = qt.TritonPackedEmbedding(product(packed, torch.bfloat16))(ids)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, dequantize(packed).to(DEVICE)[ids].to(torch.bfloat16))


# ---- availability ----------------------------------------------------------------------------

def test_unavailable_reasons_and_the_kernel() -> None:
    cuda = torch.device("cuda")
    assert qt.triton_unavailable_reason(cuda, torch.bfloat16) is None
    assert qt.triton_unavailable_reason(DEVICE, torch.float32) is None
    assert "float32, float16 or bfloat16" in qt.triton_unavailable_reason(cuda, torch.int8)
    assert "run on CUDA devices" in qt.triton_unavailable_reason(torch.device("meta"), torch.float32)
    kernel = qt.TritonKernel(DEVICE, torch.float32)
    assert kernel.name == "triton"
    assert isinstance(kernel.product(WEIGHTS["Q8_0"]()), qt.TritonPackedProduct)
    with pytest.raises(TypeError, match="its own products"):
        kernel.embedding(DenseProduct(torch.zeros(4, 32), TorchLinear()))
    with pytest.raises(ValueError, match="run on CUDA devices"):
        qt.TritonKernel(torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="k_per_split"):
        qt.LaunchConfig(block_n=32, k_per_split=96)


def test_the_default_cut_depends_on_the_weight_alone() -> None:
    """Decode-sized weights on a 132-SM GPU are split along K; a wide head is not."""
    small = qt.launch_config(576, 576, 132)
    assert small.block_n == 32 and small.k_per_split % 64 == 0 and -(-576 // small.k_per_split) > 1
    assert qt.launch_config(49152, 576, 132).k_per_split >= 576
    assert qt.launch_config(40, 256, 1).k_per_split >= 256


# Run in a fresh interpreter without TRITON_INTERPRET (interpreted kernels cannot be compiled):
# each "arch kind dtype rows" variant's launch (the split decode one with every epilogue
# input, a prefill one without), compiled by Triton's own ptxas, and _reduce; one line each.
COMPILE = """
import subprocess, sys, tempfile
from pathlib import Path
import numpy as np, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from kvserve.model.formats import triton as qt
from kvserve.model.formats.packing import GGUF_TYPES, pack_gguf, quantize_int4

def usage(fn, launch, arch):
    names = [n for n in fn.arg_names if n not in launch.constants]
    sig = {n: mangle_type(a) for n, a in zip(names, launch.args)} | {n: "constexpr" for n in launch.constants}
    aligned = [n for n, a in zip(names, launch.args)
               if isinstance(a, torch.Tensor) or (type(a) is int and a % 16 == 0)]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, constexprs=launch.constants, attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = subprocess.run([str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"),
                               "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(x for x in dump.splitlines() if "REG:" in x)
    return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK"))

dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
for variant in sys.argv[1:]:
    arch, kind, dtype, rows = variant.split()
    if kind == "int4":
        seg = quantize_int4(torch.randn(64, 512), 128).segments[0]
    else:
        _, block, nbytes = GGUF_TYPES[kind]
        data = np.random.default_rng(0).integers(0, 256, size=(64 * 512 // block, nbytes), dtype=np.uint8)
        seg = pack_gguf(kind, data, 64, 512).segments[0]
    split = rows == "1"
    launcher = qt.SegmentLaunch(seg, 0, qt.LaunchConfig(32, 128 if split else 512), dtypes[dtype], int(arch) < 80,
                               one_tile=int(arch) >= 90)
    x = torch.empty(int(rows), 512, dtype=dtypes[dtype])
    out = torch.empty(int(rows), 64, dtype=dtypes[dtype])
    epilogue = (torch.empty(64), torch.empty(int(rows), 64)) if split else (None, None)
    print(variant, "matmul", usage(qt._matmul, launcher.matmul(x, out, out, *epilogue, split), int(arch)))
    if split:
        print(variant, "reduce", usage(qt._reduce, launcher.reduce(int(rows), out, out, *epilogue, True), int(arch)))
"""


def test_kernels_compile_for_the_gpu_without_spilling() -> None:
    """What the interpreter cannot show: every kind compiles for sm_90 (wgmma for 64-row
    tiles), sm_80 and sm_75 (float32 dots), its tiles in registers."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    variants = ["90 Q4_K bf16 1", "90 Q6_K fp16 64", "90 Q8_0 fp32 64", "90 Q4_0 bf16 1", "90 int4 bf16 64",
                "80 Q4_1 bf16 64", "75 Q6_K bf16 1", "90 Q5_0 bf16 1", "90 Q5_K bf16 64", "80 Q5_1 fp16 64"]
    done = subprocess.run([sys.executable, "-c", COMPILE, *variants], check=False, capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    splits = sum(v.endswith(" 1") for v in variants)        # each split variant adds a _reduce line
    assert len(lines) == len(variants) + splits and all("STACK:0" in line for line in lines), done.stdout
