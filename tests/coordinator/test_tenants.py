"""coordinator/tenants.py: named API keys, the tenant a key names, and the cache salt."""

from __future__ import annotations

import pytest

from common.errors import InvalidOptionError
from coordinator.config import CoordinatorConfig
from coordinator.tenants import ApiKeys, cache_salt, read_keys_file


def test_a_key_names_its_tenant_and_nothing_else_does():
    keys = ApiKeys({"alice": "sk-a", "bob": "sk-b"})
    assert keys.tenant("Bearer sk-a") == "alice" and keys.tenant("bearer  sk-b ") == "bob"
    assert keys.tenant("Bearer sk-c") is None and keys.tenant("sk-a") is None
    assert keys.tenant(None) is None and not keys.matches("Basic sk-a")


def test_the_single_api_key_is_the_default_tenant_beside_named_ones():
    config = CoordinatorConfig(api_key="sk-main", tenant_keys=(("alice", "sk-a"),))
    keys = config.api_keys()
    assert keys.tenant("Bearer sk-main") == "default" and keys.tenant("Bearer sk-a") == "alice"
    assert CoordinatorConfig().api_keys() is None
    with pytest.raises(ValueError, match="visible"):
        CoordinatorConfig(tenant_keys=(("alice", "has space"),))


def test_salts_separate_tenants_and_request_salts_but_not_an_open_server():
    assert cache_salt("") == b""  # no keys, no salt: one shared cache
    salts = {cache_salt("alice"), cache_salt("bob"), cache_salt("alice", "s1"),
             cache_salt("bob", "s1"), cache_salt("", "s1")}
    assert len(salts) == 5 and all(len(s) == 16 for s in salts)
    assert cache_salt("alice", "s1") == cache_salt("alice", "s1")
    with pytest.raises(InvalidOptionError, match="cache_salt"):
        cache_salt("alice", "x" * 257)


def test_keys_file_format_and_its_errors(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nalice sk-a\n\nbob   sk-b\n")
    assert read_keys_file(path) == {"alice": "sk-a", "bob": "sk-b"}
    for bad, words in [("alice\n", ":1: expected"), ("alice sk-a\nalice sk-c\n", ":2: the name"),
                       ("alice sk-a\nbob sk-a\n", ":2: the name or key"), ("# none\n", "no keys"),
                       ("al ice sk-a\n", ":1: expected")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=words):
            read_keys_file(path)
