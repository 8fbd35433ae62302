"""Tenants and cache salts: a tenant (or a salt) cannot see another's cached prompt, through
``cached_tokens``, pins or the cache routes, nor drop another's cache state; no salt string
reaches another tenant's namespace or the server's; the server key's rights over tenants; the
same tenant and salt share as before."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from live_server import MODEL, running_server

from kvserve.server.cli import read_tenant_keys

SECRET = ("You are the vault assistant. The vault code is 4417-9921-3306. Never reveal the code to anyone. "
          "Answer questions about opening hours only; the vault opens at nine and closes at five.")
KEYS = {"alice-key": "alice", "bob-key": "bob"}


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, api_key="own-key", tenant_keys=KEYS, num_kv_blocks=64) as s:
        yield s


def cached(server, key: str, **extra: object) -> int:
    body = {"model": MODEL, "prompt": SECRET + " Question: when does it open?", "max_tokens": 1, "temperature": 0,
            **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_hits_another_tenants_prompt(server):
    assert cached(server, "alice-key") == 0
    assert cached(server, "alice-key") > 0                # alice hits her own prompt
    assert cached(server, "bob-key") == 0                 # bob guesses it right, and learns nothing
    assert cached(server, "own-key") == 0                 # nor does the server's own namespace
    assert cached(server, "bob-key") > 0                  # bob now hits his own copy


def test_cache_salts_partition_one_tenant(server):
    assert cached(server, "alice-key", cache_salt="project-1") == 0
    assert cached(server, "alice-key", cache_salt="project-2") == 0
    assert cached(server, "alice-key", cache_salt="project-1") > 0
    bad = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer alice-key"},
                     json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def call(server, method: str, route: str, key: str, body: dict | None = None) -> httpx.Response:
    """A cache route (``/v1/cache/{route}``) as the holder of ``key``."""
    r = httpx.request(method, f"{server.url}/v1/cache/{route}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})
    assert r.status_code < 500, r.text
    return r


def test_pins_belong_to_their_tenant(server):
    assert call(server, "POST", "pin", "alice-key", {"prompt": SECRET}).status_code == 200
    assert len(call(server, "GET", "pins", "alice-key").json()["data"]) == 1
    assert call(server, "GET", "pins", "bob-key").json()["data"] == []
    assert call(server, "POST", "unpin", "bob-key", {"all": True}).json()["data"] == []      # bob removes nothing
    assert call(server, "POST", "unpin", "bob-key", {"prompt": SECRET}).status_code == 404   # nor alice's pin
    assert len(call(server, "POST", "unpin", "alice-key", {"all": True}).json()["data"]) == 1


def test_an_unknown_key_is_refused(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers={"Authorization": "Bearer carol-key"})
    assert r.status_code == 401


def test_tenant_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenant key\nalice k1\n\nbob k2\n")
    assert read_tenant_keys(str(path)) == {"k1": "alice", "k2": "bob"}
    path.write_text("alice k1\nbob k1\n")
    with pytest.raises(ValueError, match=":2: want 'TENANT KEY'"):
        read_tenant_keys(str(path))


def alice_state(server) -> tuple[list, int]:
    """Alice's pins (as listed to her) and the cached tokens of her repeat."""
    pins = call(server, "GET", "pins", "alice-key").json()
    assert pins["scope"] == "tenant" and pins["tenant"] == "alice"
    return [(p["block_keys"], p["tenant"]) for p in pins["data"]], cached(server, "alice-key")


def test_a_tenants_reset_leaves_the_others_blocks_and_pins(server):
    assert call(server, "POST", "reset", "own-key").json()["scope"] == "engine"     # a clean start
    assert call(server, "POST", "pin", "alice-key", {"prompt": SECRET}).json()["tenant"] == "alice"
    assert cached(server, "alice-key") > 0 and cached(server, "bob-key") == 0     # bob computes his own copy
    assert cached(server, "bob-key") > 0
    before = alice_state(server)
    assert len(before[0]) == 1 and before[1] > 0
    reset = call(server, "POST", "reset", "bob-key").json()
    assert reset["scope"] == "tenant" and reset["tenant"] == "bob" and reset["num_dropped_blocks"] > 0
    assert alice_state(server) == before                # her pin, and her repeat hits as much as before
    assert cached(server, "bob-key") == 0               # bob's own blocks went
    # the server key's reset is the engine's: every tenant's blocks, pinned ones too (the pins stay)
    reset = call(server, "POST", "reset", "own-key").json()
    assert reset == {"reset": True, "num_dropped_blocks": reset["num_dropped_blocks"], "scope": "engine"}
    assert reset["num_dropped_blocks"] > 0
    assert cached(server, "alice-key") == 0 and len(alice_state(server)[0]) == 1
    call(server, "POST", "unpin", "alice-key", {"all": True})


def test_no_cache_route_of_one_tenant_touches_another(server):
    """The cross-tenant probe over every cache route: whatever bob sends, alice's pins and
    blocks are as they were, and bob learns nothing of them."""
    call(server, "POST", "reset", "own-key")
    call(server, "POST", "pin", "alice-key", {"prompt": SECRET, "ttl": 600})
    cached(server, "alice-key", cache_salt="project-1")
    before = alice_state(server)
    probes = [("GET", "pins", None), ("POST", "unpin", {"all": True}), ("POST", "unpin", {"prompt": SECRET}),
              ("POST", "unpin", {"prompt": SECRET, "cache_salt": "project-1"}), ("POST", "reset", None),
              ("POST", "pin", {"prompt": SECRET, "ttl": 5}), ("POST", "unpin", {"prompt": SECRET}),
              ("POST", "pin", {"prompt": SECRET, "cache_salt": "project-1", "warm": False}), ("POST", "reset", None),
              ("POST", "unpin", {"all": True})]
    for method, route, body in probes:
        r = call(server, method, route, "bob-key", body)
        answer = r.json()
        if "scope" in answer:
            assert answer["scope"] == "tenant" and answer["tenant"] == "bob", (route, answer)
        if route == "pins" or (route == "unpin" and body == {"all": True}):
            assert all(p["tenant"] == "bob" for p in answer["data"]), (route, answer)
        if route == "pin":
            assert r.status_code == 200 and answer["tenant"] == "bob"     # bob's own pin, in his namespace
            assert answer["block_keys"] != before[0][0][0]
        if route == "unpin" and "prompt" in body:
            assert r.status_code in (200, 404) and (r.status_code == 404 or answer["tenant"] == "bob")
        assert alice_state(server) == before, (method, route, body)
    assert cached(server, "alice-key", cache_salt="project-1") > 0
    call(server, "POST", "unpin", "alice-key", {"all": True})


def test_the_server_keys_rights_over_tenants(server):
    """The server key is the operator: its listings and resets reach every tenant's cache state,
    and say so; its own requests, pins and unpins by prompt stay in the engine's own namespace."""
    call(server, "POST", "reset", "own-key")
    call(server, "POST", "pin", "alice-key", {"prompt": SECRET})
    call(server, "POST", "pin", "bob-key", {"prompt": SECRET, "cache_salt": "b"})
    listed = call(server, "GET", "pins", "own-key").json()
    assert listed["scope"] == "engine" and "tenant" not in listed
    assert sorted(p["tenant"] for p in listed["data"]) == ["alice", "bob"]
    assert call(server, "POST", "unpin", "own-key", {"prompt": SECRET}).status_code == 404   # not its namespace
    own = call(server, "POST", "pin", "own-key", {"prompt": SECRET}).json()
    assert own["tenant"] is None and own["block_keys"] not in [p["block_keys"] for p in listed["data"]]
    assert cached(server, "alice-key") > 0 and cached(server, "own-key") > 0
    gone = call(server, "POST", "unpin", "own-key", {"all": True}).json()
    assert gone["scope"] == "engine" and sorted(str(p["tenant"]) for p in gone["data"]) == ["None", "alice", "bob"]
    assert call(server, "GET", "pins", "alice-key").json()["data"] == []


SALTS = st.text(st.characters() | st.sampled_from(["\x1f", "\x00", ":", "5", "\u2028", "\U0001f600"]),
                min_size=1, max_size=256)


def test_no_salt_reaches_another_tenants_or_the_servers_blocks(server):
    """Whatever salt bob or the server key sends (separators, digits that look like lengths,
    unicode, 256 characters), the secret alice and the server's own namespace computed is a miss."""
    call(server, "POST", "reset", "own-key")
    call(server, "POST", "pin", "alice-key", {"prompt": SECRET})
    call(server, "POST", "pin", "own-key", {"prompt": SECRET})       # the server's own namespace holds it too
    seen: set[tuple[str, str]] = set()

    @given(caller=st.sampled_from(["bob-key", "own-key"]), salt=SALTS)
    @example(caller="own-key", salt="alice\x1f")        # the probe under the old scheme
    @example(caller="own-key", salt="alice")
    @example(caller="bob-key", salt="\x1f")
    @example(caller="own-key", salt="5:alice")
    @settings(max_examples=24, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def probe(caller: str, salt: str) -> None:
        if (caller, salt) in seen:      # its own namespace computed the prompt already
            return
        seen.add((caller, salt))
        assert cached(server, caller, cache_salt=salt) == 0, (caller, salt)

    probe()
    assert cached(server, "alice-key") > 0 and cached(server, "own-key") > 0
    call(server, "POST", "unpin", "own-key", {"all": True})


def test_per_tenant_figures_are_counts_only(server):
    text = httpx.get(f"{server.url}/metrics").text
    for tenant in ("alice", "bob"):
        assert server.metric(f'kvserve_tenant_requests_total{{tenant="{tenant}"}}') > 0
        assert server.metric(f'kvserve_tenant_prompt_tokens_total{{tenant="{tenant}"}}') > 0
        assert server.metric(f'kvserve_tenant_cache_resets_total{{tenant="{tenant}"}}') >= 0
        assert f'kvserve_tenant_cached_blocks{{tenant="{tenant}"}}' in text
        assert f'kvserve_tenant_pins{{tenant="{tenant}"}}' in text
    assert server.metric('kvserve_tenant_cache_resets_total{tenant="bob"}') >= 1
    assert 'tenant=""' not in text                      # the server's own namespace has no tenant series
    for secret in ("alice-key", "bob-key", "own-key", "project-1", "4417"):
        assert secret not in text                       # no key, salt or prompt
