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


def test_a_password_in_the_extra_config_is_refused(tmp_path):
    """Issue 54 (3): vLLM prints kv_connector_extra_config at start-up ("non-default args"): a store URL with a
    password there is refused, naming the ways that keep it out of vLLM's arguments (never the password)."""
    for url in (
        f"redis://:{SECRET}@127.0.0.1:6379/0",
        f"rediss://app:{SECRET}@h:1/0",
        f"redis://h:1/0?password={SECRET}",
    ):
        with pytest.raises(ValueError, match="VERICACHE_STORE_PASSWORD_FILE") as e:
            load_connector_config({"store": url}, env={})
        assert SECRET not in str(e.value) and "VERICACHE_STORE_URL" in str(e.value)
    # the same URL from the environment (a Kubernetes Secret) is fine: vLLM never prints it
    cfg = load_connector_config({}, env={"VERICACHE_STORE_URL": f"redis://:{SECRET}@127.0.0.1:6379/0"})
    assert cfg.url == f"redis://:{SECRET}@127.0.0.1:6379/0"


def test_the_store_password_from_a_file_or_the_environment(tmp_path):
    odd = "p/w?#@:%x"  # every character a URL would misread, percent-encoded into it
    (tmp_path / "pw").write_text(odd + "\n")
    env = {"VERICACHE_STORE_PASSWORD_FILE": str(tmp_path / "pw")}
    cfg = load_connector_config({"store": "redis://127.0.0.1:6379/0"}, env=env)
    assert cfg.url == "redis://:p%2Fw%3F%23%40%3A%25x@127.0.0.1:6379/0" and odd not in repr(cfg)
    cfg = load_connector_config(
        {"store": "redis+sentinel://app@s1:26379,s2:26379/mymaster"}, env={"VERICACHE_STORE_PASSWORD": "pw"}
    )
    assert cfg.url == "redis+sentinel://app:pw@s1:26379,s2:26379/mymaster"
    with pytest.raises(ValueError, match="not both"):
        load_connector_config({}, env={**env, "VERICACHE_STORE_PASSWORD": "pw"})
    with pytest.raises(ValueError, match="one way, not two") as e:
        load_connector_config({}, env={**env, "VERICACHE_STORE_URL": f"redis://:{SECRET}@h:1/0"})
    assert SECRET not in str(e.value)
    with pytest.raises(ValueError, match="s3:// store takes no password"):
        load_connector_config({"store": "s3://bucket/kv"}, env=env)
    with pytest.raises(ValueError, match="is empty"):
        (tmp_path / "empty").write_text("\n")
        load_connector_config({}, env={"VERICACHE_STORE_PASSWORD_FILE": str(tmp_path / "empty")})


@pytest.mark.parametrize("key", ["timeout_s", "bandwidth_bytes_per_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_numbers_must_be_finite(key, value):
    """Issue 54 (4): NaN passed the > 0 check and silently disabled the store."""
    with pytest.raises(ValueError, match=f"{key} must be a finite number > 0") as e:
        load_connector_config({"store": "redis://h:1/0", key: value}, env={})
    assert repr(value) in str(e.value)
