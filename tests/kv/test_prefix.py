from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvserve.kv.prefix import block_key, extend_block_keys, make_extra_key, salted_extra_key


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


# separators, control characters, digits that look like lengths, unicode (surrogates too), long names
_NAMES = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=300) | st.sampled_from(
    ["", "alice", "alice\x1f", "\x1falice", "5:alice", "alice\x00", "\x00tenant\x00", "ali", "ce"])


@settings(max_examples=500, deadline=None)
@given(a=st.tuples(_NAMES, _NAMES), b=st.tuples(_NAMES, _NAMES))
def test_no_two_namespaces_share_an_extra_key(a, b):
    """(tenant, salt) -> extra key is one to one: no salt spells another tenant's namespace, the
    engine's own ("") or another salt's, whatever characters either holds."""
    extra = make_extra_key("fp", "native", secret=b"k" * 32)
    assume(a != b)
    assert salted_extra_key(extra, a[1], a[0]) != salted_extra_key(extra, b[1], b[0])


def test_the_issues_spellings_are_other_namespaces():
    extra = make_extra_key("fp", "native")
    alice = salted_extra_key(extra, "", "alice")
    # the server's own namespace with the separator the old scheme put between tenant and salt
    assert salted_extra_key(extra, "alice\x1f") != alice
    assert salted_extra_key(extra, "", "alice") == alice and salted_extra_key(extra, "") == extra
    assert salted_extra_key(extra, "x", "alice") != salted_extra_key(extra, "", "alicex")
    assert salted_extra_key(extra, "ce", "ali") != salted_extra_key(extra, "", "alice")
