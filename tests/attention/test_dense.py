"""``AttentionBackend.attend_dense`` (blending's passes: one sequence's dense keys and values,
queries at given positions) in every backend this machine runs, against the routes blending
took before the backends owned the call (restated below): bit for bit where a backend takes
the same route, to float32 rounding where it takes another.

Triton runs on the CPU under its interpreter (the kernels' module imported with
TRITON_INTERPRET=1, as tests/attention/test_triton.py does); its ``attend_dense`` is the
portable path, so no kernel is launched.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention import cpu
from kvserve.attention.backends import ATTENTION_BACKENDS, AttentionBackend, make_attention_backend
from kvserve.kv.storage.layout import CodecKind, HalfLayout, HalfStore, PagedBatch

CPU = torch.device("cpu")
HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.3


def _interpret_triton() -> None:
    """Import the Triton kernels' module for the interpreter (no GPU here), before any test
    module imports triton otherwise; a missing triton leaves the backend unavailable."""
    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("kvserve.attention.triton_kernels")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_interpret_triton()
BACKENDS = [name for name, b in ATTENTION_BACKENDS.items() if b.unavailable_reason(CPU) is None]


@pytest.fixture(params=BACKENDS)
def backend(request) -> AttentionBackend:
    return make_attention_backend(request.param, CPU)


def before(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Blending's attention before the backends owned it: every position a query, one causal
    SDPA call; else the C++ kernel over the dense KV as blocks of 16 (float32 on the CPU,
    whatever the engine's backend); else masked SDPA calls of 64 queries."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.to(q.dtype), v.to(q.dtype)))
    if rows.numel() == k.shape[0]:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    if k.dtype == v.dtype == torch.float32 and cpu.is_available():
        return kernel_route(q, k, v, rows, scale)
    return masked_route(qs, ks, vs, rows, scale)


def kernel_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    n = int(rows[-1]) + 1
    size = -(-n // 16) * 16
    layout = HalfLayout(CodecKind.PLAIN, plain_dtype=torch.float32)
    halves = [HalfStore(layout, {"data": torch.cat([x[:n], x.new_zeros((size - n, *x.shape[1:]))]).view(-1, 16,
                                                                                                     *x.shape[1:])})
              for x in (k, v)]
    batch = PagedBatch(torch.arange(size // 16, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
                       torch.tensor([0, rows.numel()], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32),
                       16, rows.numel(), n, rows.to(torch.int32))
    return cpu.paged_attention(q, halves[0], halves[1], batch, scale)


def masked_route(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, rows: torch.Tensor,
                 scale: float) -> torch.Tensor:
    outs = []
    for first in range(0, rows.numel(), 64):
        chunk = rows[first:first + 64]
        end = int(chunk[-1]) + 1
        mask = torch.arange(end)[None, :] <= chunk[:, None]
        outs.append(F.scaled_dot_product_attention(qs[:, :, first:first + 64], ks[:, :, :end], vs[:, :, :end],
                                                   attn_mask=mask, scale=scale, enable_gqa=True))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


def case(n: int, num_rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries at ``num_rows`` ascending positions of n, the last one n - 1; keys and values of n."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.sort(torch.randperm(n - 1, generator=gen)[:num_rows - 1]).values
    rows = torch.cat([rows, torch.tensor([n - 1])])
    q = torch.randn(num_rows, HEADS, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, num_rows", [(150, 70), (37, 5), (16, 1)])
def test_attend_dense_gives_blendings_numbers(backend, dtype, n, num_rows):
    """Rows at gaps (more than one call of 64, a few, one): the cpu backend's call is blending's
    route before it, bit for bit (the kernel on float32, masked calls else); the others are the
    masked calls bit for bit, and where blending read float32 through the kernel whatever the
    engine's backend, within float32 rounding of it."""
    q, k, v, rows = case(n, num_rows, dtype, seed=n)
    got = backend.attend_dense(q, k, v, rows, SCALE)
    assert got.shape == q.shape and got.dtype == dtype
    want = before(q, k, v, rows, SCALE)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if backend.name == "cpu":
        assert torch.equal(got, want)
    else:
        assert torch.equal(got, masked_route(qs, ks, vs, rows, SCALE))
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_position_a_query_is_the_causal_prefill(backend, dtype):
    q, k, v, rows = case(40, 40, dtype, seed=1)
    assert rows.tolist() == list(range(40))
    assert torch.equal(backend.attend_dense(q, k, v, rows, SCALE), before(q, k, v, rows, SCALE))


def test_rows_past_the_last_query_are_never_read(backend):
    """A KV allocated ``dense_rows`` long (the cpu backend reads whole blocks of 16 in place),
    the rows past the last query's position full of garbage: the same output as without them."""
    q, k, v, rows = case(37, 9, torch.float32, seed=2)
    size = backend.dense_rows(37)
    assert size == (48 if backend.name == "cpu" else 37)
    padded = [torch.cat([x, torch.full((size - 37 + 5, KV_HEADS, DIM), 1e4)]) for x in (k, v)]
    short = rows[rows < 30]
    assert torch.equal(backend.attend_dense(q[:short.numel()], *padded, short, SCALE),
                       backend.attend_dense(q[:short.numel()], k[:30], v[:30], short, SCALE))
    assert torch.equal(backend.attend_dense(q, padded[0][:size], padded[1][:size], rows, SCALE),
                       backend.attend_dense(q, k, v, rows, SCALE))
