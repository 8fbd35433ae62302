"""The reference attention itself: exact on lossless storage, and it reads what the layout says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention.cases import make_case

from kvserve.kv.codecs import parse_codec
from kvserve.kv.storage.layout import CodecKind, HalfLayout


def dense(case, s: int) -> torch.Tensor:
    """SDPA over sequence s's raw keys and values, its queries causal at the end."""
    start, end = case.batch.query_starts[s].item(), case.batch.query_starts[s + 1].item()
    k, v = case.raw_keys[s], case.raw_values[s]
    q = case.q[start:end].float()
    group = q.shape[1] // k.shape[1]
    n, length = end - start, k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                       v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask,
                                       scale=case.scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 3])
def test_lossless_reference_is_dense_attention(group: int) -> None:
    lens, queries = [1, 16, 37, 200], [1, 5, 37, 1]
    case = make_case("fp32", lens=lens, num_queries=queries, group=group)
    out = case.reference()
    starts = case.batch.query_starts.tolist()
    for s in range(len(lens)):
        torch.testing.assert_close(out[starts[s]:starts[s + 1]], dense(case, s), atol=1e-5, rtol=1e-5)


def test_open_blocks_of_whole_block_halves_come_from_residual_rows() -> None:
    case = make_case("kivi2", lens=[20, 32], num_queries=[1, 1])
    assert case.key.residual is not None and case.value.residual is None
    assert case.batch.open_rows.tolist() == [0, -1]
    # the open block's keys are exact (full precision); the others are quantized
    torch.testing.assert_close(case.key.residual[0, :4], case.raw_keys[0][16:20])


def test_layouts_of_every_codec() -> None:
    def layout(token: str, half: str = "k") -> HalfLayout:
        return HalfLayout.from_codec(parse_codec(token, half, torch.float32))  # type: ignore[arg-type]

    assert layout("native") == HalfLayout(CodecKind.PLAIN, plain_dtype=torch.float32)
    assert layout("bf16").plain_dtype == torch.bfloat16
    assert layout("kivi2") == HalfLayout(CodecKind.ASYM_CHANNEL, bits=2)
    assert layout("kivi2", "v") == HalfLayout(CodecKind.ASYM_TOKEN, bits=2, group_size=32)
    assert layout("int4g64+had+out4") == HalfLayout(CodecKind.ASYM_TOKEN, bits=4, group_size=64, hadamard=True,
                                                    num_outliers=4)
    assert layout("fp8").kind == CodecKind.FP8 and layout("int8").kind == CodecKind.INT8
    assert [layout(t).encodes_whole_blocks for t in ("int8", "kivi4", "int8+out2")] == [False, True, True]
