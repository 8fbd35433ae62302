import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.kv.block_io import block_nbytes, read_blocks, write_blocks


@pytest.mark.parametrize("fmt", ["native", "int8", "kivi2g8"])
def test_payload_round_trips_between_blocks_and_engines(fmt):
    loaded = tiny_model()
    src = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=8)
    prompt = list(range(40))
    ref = src.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    tensors = src.engine.runner.cache.block_tensors()
    nbytes = block_nbytes(tensors)
    # tiny: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims
    per_half = {"native": 16 * 2 * 16 * 4, "int8": 16 * 2 * (16 + 2)}.get(fmt)
    if per_half is not None:
        assert nbytes == 2 * 2 * per_half
    payloads = read_blocks(tensors, [0, 1])
    assert payloads.shape == (2, nbytes) and payloads.dtype == torch.uint8
    # another engine gets the two full blocks by payload, then reads them as its own
    dst = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=8)
    dst_tensors = dst.engine.runner.cache.block_tensors()
    write_blocks(dst_tensors, [5, 6], payloads)
    assert torch.equal(read_blocks(dst_tensors, [5, 6]), payloads)
    assert torch.equal(read_blocks(dst_tensors, [0]), torch.zeros(1, nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="payloads must be uint8"):
        write_blocks(dst_tensors, [1], payloads[:, :-1])
    assert ref.token_ids
