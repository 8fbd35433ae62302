"""Tenants and cache salts: a tenant (or a salt) cannot see another's cached prompt, through
``cached_tokens``, pins or the cache routes; the same tenant and salt share as before."""

from __future__ import annotations

import httpx
import pytest
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


def test_pins_belong_to_their_tenant(server):
    def call(method: str, route: str, key: str, body: dict | None = None) -> httpx.Response:
        return httpx.request(method, f"{server.url}/v1/cache/{route}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {key}"})

    assert call("POST", "pin", "alice-key", {"prompt": SECRET}).status_code == 200
    assert len(call("GET", "pins", "alice-key").json()["data"]) == 1
    assert call("GET", "pins", "bob-key").json()["data"] == []
    assert call("POST", "unpin", "bob-key", {"all": True}).json()["data"] == []      # bob removes nothing
    assert call("POST", "unpin", "bob-key", {"prompt": SECRET}).status_code == 404   # nor alice's pin
    assert len(call("POST", "unpin", "alice-key", {"all": True}).json()["data"]) == 1


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
