import hashlib

import pytest
import torch

from kvserve.offload.serialization import HEADER_NBYTES, CorruptBlockError, decode_block, encode_block

KEY = hashlib.sha256(b"block 0").digest()
OTHER_KEY = hashlib.sha256(b"block 1").digest()
FMT = hashlib.sha256(b"model=m\x00format=int8").digest()
PAYLOAD = bytes(range(256)) * 40 + b"tail"


def test_header_is_64_bytes_and_round_trips_any_buffer():
    assert HEADER_NBYTES == 64
    data = encode_block(KEY, FMT, PAYLOAD)
    assert len(data) == HEADER_NBYTES + len(PAYLOAD)
    assert data[:4] == b"KVSB" and data[8:40] == KEY
    assert decode_block(data, KEY, FMT) == PAYLOAD
    # the forms a payload arrives in: a row of read_blocks' uint8 tensor, bytearray, memoryview
    row = torch.arange(300, dtype=torch.int32).view(torch.uint8).reshape(2, -1)[1]
    assert decode_block(encode_block(KEY, FMT, row.numpy()), KEY, FMT) == row.numpy().tobytes()
    assert decode_block(encode_block(KEY, "int8", bytearray(b"ab")), KEY, "int8") == b"ab"
    assert decode_block(memoryview(encode_block(KEY, FMT, memoryview(b""))), KEY, FMT) == b""


def _reason(data, key=KEY, fmt=FMT):
    with pytest.raises(CorruptBlockError) as info:
        decode_block(data, key, fmt)
    assert info.value.key == key and info.value.reason.replace("_", " ") in str(info.value)
    return info.value.reason


def _flip(data, offset):
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def test_each_kind_of_corruption_is_named():
    data = encode_block(KEY, FMT, PAYLOAD)
    assert _reason(_flip(data, HEADER_NBYTES + 1000)) == "checksum_mismatch"
    assert _reason(_flip(data, len(data) - 1)) == "checksum_mismatch"
    assert _reason(data[:-1]) == "truncated"
    assert _reason(data[:HEADER_NBYTES]) == "truncated"
    assert _reason(data[:10]) == "truncated"
    assert _reason(b"") == "truncated"
    assert _reason(data + b"\x00") == "length_mismatch"
    assert _reason(data, key=OTHER_KEY) == "wrong_key"
    assert _reason(data, fmt=b"another format") == "wrong_format"
    assert _reason(data, fmt="int8") == "wrong_format"


@pytest.mark.parametrize("offset, reason", [
    (0, "bad_magic"), (3, "bad_magic"), (4, "bad_version"), (6, "bad_version"), (8, "wrong_key"),
    (39, "wrong_key"), (40, "wrong_format"), (47, "wrong_format"), (48, "truncated"),
    (55, "truncated"), (56, "checksum_mismatch"), (59, "checksum_mismatch"), (60, "checksum_mismatch"),
    (63, "checksum_mismatch"),
])
def test_a_flipped_header_byte_is_caught(offset, reason):
    # the length field: PAYLOAD is 10244 bytes, so a flip at 48 declares 10245 and one at 55 about 2**56
    assert len(PAYLOAD) % 2 == 0
    assert _reason(_flip(encode_block(KEY, FMT, PAYLOAD), offset)) == reason


def test_every_single_bit_flip_in_the_header_is_caught():
    data = encode_block(KEY, FMT, b"x" * 100)
    for offset in range(HEADER_NBYTES):
        for bit in range(8):
            bad = bytearray(data)
            bad[offset] ^= 1 << bit
            with pytest.raises(CorruptBlockError):
                decode_block(bytes(bad), KEY, FMT)


def test_a_key_that_is_not_32_bytes_is_misuse():
    with pytest.raises(ValueError, match="32 bytes"):
        encode_block(b"short", FMT, b"x")
    with pytest.raises(ValueError, match="32 bytes"):
        decode_block(encode_block(KEY, FMT, b"x"), b"short", FMT)
