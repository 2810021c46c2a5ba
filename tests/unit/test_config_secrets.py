"""A store password never shows: not in RemoteCacheConfig's errors or repr, not in the vLLM connector's
config errors (kv_connector_extra_config, --kv-transfer-config), however broken the URL or the JSON."""

from __future__ import annotations

import json

import pytest

from vericache_connector.integration.vllm.connector.config import load_connector_config, load_kv_transfer_config
from vericache_connector.remote import RemoteCacheConfig

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{SECRET}@127.0.0.1:6379/0",  # unknown scheme
        f"redis//:{SECRET}@127.0.0.1:6379/0",  # no ://
        f"redis:{SECRET}@127.0.0.1",
        f"redis://:{SECRET}@127.0.0.1:6379/0?timeout_s=3",  # refused option
        f"redis://:{SECRET}@[::1:6379/0",  # does not parse
        f"ftp://{SECRET}@host/x",  # a token as the user name
    ],
)
def test_bad_url_errors_hide_the_password(url):
    with pytest.raises(ValueError) as e:
        RemoteCacheConfig(url=url)
    assert SECRET not in str(e.value) and "***" in str(e.value)
    with pytest.raises(ValueError) as e:
        load_connector_config({"store": url}, env={})
    assert SECRET not in str(e.value)
    with pytest.raises(ValueError) as e:
        load_connector_config({}, env={"VERICACHE_STORE_URL": url})
    assert SECRET not in str(e.value)


def test_repr_hides_the_password():
    cfg = RemoteCacheConfig(url=f"redis://:{SECRET}@127.0.0.1:6379/0", compressor="int8")
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    assert "redis://:***@127.0.0.1:6379/0" in repr(cfg) and "compressor='int8'" in repr(cfg)
    assert cfg.url == f"redis://:{SECRET}@127.0.0.1:6379/0"  # the value itself is intact


@pytest.mark.parametrize(
    "text",
    [
        '{"store": "redis://:%s@127.0.0.1:6379/0", "compressor": }' % SECRET,  # not JSON
        '["redis://:%s@127.0.0.1:6379/0"]' % SECRET,  # not an object
        json.dumps({"kv_connector": "Other", "kv_connector_extra_config": {"store": f"rediss://u:{SECRET}@h:1/0"}}),
    ],
)
def test_json_errors_hide_the_password(text):
    with pytest.raises(ValueError) as e:
        load_kv_transfer_config(text, env={})
    assert SECRET not in str(e.value)
    if text.startswith("{"):
        with pytest.raises(ValueError) as e:
            load_connector_config(text, env={})
        assert SECRET not in str(e.value)


def test_a_non_string_store_value_hides_the_password():
    with pytest.raises(ValueError, match="must be a string") as e:
        load_connector_config({"store": [f"redis://:{SECRET}@h:1/0"]}, env={})
    assert SECRET not in str(e.value)
