from kvserve.kv.prefix import block_key, extend_block_keys, make_extra_key


def test_keys_chain_and_depend_on_everything():
    e = make_extra_key("fp", "native")
    k0 = block_key(None, [1, 2], e)
    assert block_key(None, [1, 2], e) == k0                       # deterministic
    assert block_key(None, [1, 3], e) != k0                       # tokens
    assert block_key(k0, [1, 2], e) != k0                         # parent
    assert block_key(None, [1, 2], make_extra_key("fp", "int8")) != k0   # format
    assert block_key(None, [1, 2], make_extra_key("other", "native")) != k0  # model
    assert block_key(None, [1, 2], make_extra_key("fp", "native", "salt")) != k0
    assert len(k0) == 32


def test_extend_block_keys_only_full_blocks_and_incremental():
    e = make_extra_key("fp", "native")
    keys: list[bytes] = []
    extend_block_keys(keys, [1, 2, 3, 4, 5], 2, e)
    assert len(keys) == 2
    assert keys[1] == block_key(keys[0], [3, 4], e)
    first = list(keys)
    extend_block_keys(keys, [1, 2, 3, 4, 5, 6], 2, e)
    assert keys[:2] == first and len(keys) == 3
    assert keys[2] == block_key(keys[1], [5, 6], e)


def test_a_secret_keys_every_block_and_is_made_once(tmp_path):
    import os

    import pytest

    from kvserve.kv.prefix import SECRET_NBYTES, load_or_create_secret

    path = tmp_path / "dir" / "secret"
    secret = load_or_create_secret(path)
    assert len(secret) == SECRET_NBYTES and load_or_create_secret(path) == secret
    assert os.stat(path).st_mode & 0o777 == 0o600 and [p.name for p in path.parent.iterdir()] == ["secret"]
    plain = make_extra_key("fp", "native")
    keyed = make_extra_key("fp", "native", secret=secret)
    assert keyed != plain and keyed != make_extra_key("fp", "native", secret=b"x" * SECRET_NBYTES)
    assert block_key(None, [1, 2], keyed) != block_key(None, [1, 2], plain)
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="holds 5 bytes"):
        load_or_create_secret(path)
