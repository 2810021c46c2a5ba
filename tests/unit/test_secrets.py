"""Secrets never print: one redaction (storage_backends.credentials.redact_url) in every error, repr and
log line that can hold a store URL, fuzzed with passwords that hold reserved characters; secrets read
from mounted files or the environment; the MAC key never shown."""

from __future__ import annotations

import logging
import random
import re
import string
from urllib.parse import quote

import pytest

from storage_backends import StoreError, open_backend, redact_url

from stores import closed_port, has_module, run

# URL skeletons use lowercase letters, digits and punctuation only; passwords always hold upper-case
# letters (and reserved characters), so a leak of any part of one shows as an upper-case letter or '%'.
RESERVED = "/?#@:%[]!$&'()*+,;= ~\\\""
LEAK = re.compile(r"[A-Z%]")


def password(rnd: random.Random) -> str:
    """Upper-case segments joined by runs of reserved characters (what cuts a URL short)."""
    segments = ["".join(rnd.choice(string.ascii_uppercase) for _ in range(rnd.randint(4, 8))) for _ in range(3)]
    joins = ["".join(rnd.choice(RESERVED) for _ in range(rnd.randint(0, 3))) for _ in range(4)]
    return "".join(j + s for j, s in zip(joins, segments + [""]))


def leaks(text: str, pw: str) -> list[str]:
    """The segments of pw (upper-case runs of 4+) that text holds."""
    return [seg for seg in re.findall(r"[A-Z]{4,}", pw) if seg in text]


def skeleton(rnd: random.Random) -> tuple[str, str, str]:
    """(scheme prefix, user, tail after the '@')."""
    scheme = rnd.choice(["redis://", "rediss://", "s3://", "nixl://", "redis//", "redis:/", "redis:", ""])
    user = rnd.choice(["", "", "app", "default", "svc-user.1"])
    host = rnd.choice(["redis", "127.0.0.1", "vericache-redis.ns.svc", "[::1]"])
    tail = f"{host}:{rnd.randint(1, 65535)}/{rnd.randint(0, 15)}"
    tail += rnd.choice(["", "?prefix=t1:", "?prefix=a&max_connections=4", "#frag"])
    return scheme, user, tail


def test_redact_url_fuzz_hides_passwords_with_reserved_characters():
    rnd = random.Random(1234)
    for _ in range(3000):
        scheme, user, tail = skeleton(rnd)
        pw = password(rnd)
        for url in (f"{scheme}{user}:{pw}@{tail}", f"{scheme}{user}:{quote(pw, safe='')}@{tail}"):
            shown = redact_url(url)
            assert not LEAK.search(shown), (url, shown)
            assert shown.endswith(f"@{tail}") and "***" in shown, (url, shown)
        if scheme.endswith("://"):  # a well-formed (percent-encoded) URL keeps everything but the user info
            assert (
                redact_url(f"{scheme}{user}:{quote(pw, safe='')}@{tail}")
                == f"{scheme}{':' if not user else ''}***@{tail}"
            )
        token = "".join(rnd.choice(string.ascii_uppercase) for _ in range(8))  # user info without ':'
        assert not LEAK.search(redact_url(f"{scheme}{token}@{tail}"))


def test_redact_url_hides_credential_query_options_and_keeps_plain_urls():
    # masked to the end: an unescaped '&', ';' or '#' in the value would otherwise end it early
    assert redact_url("s3://b/p?region=x&aws_secret_access_key=AB&C") == "s3://b/p?region=x&aws_secret_access_key=***"
    assert redact_url("redis://h:1/0?password=AB#C") == "redis://h:1/0?password=***"
    assert redact_url("nixl://h:5555?token=ABC") == "nixl://h:5555?token=***"
    assert redact_url("local://x?password=A@B&bogus=1") == "local://***"
    for url in ("redis://h:6379/0", "local:///tmp/kv", "s3://b/p?endpoint_url=http://127.0.0.1:9000&region=x"):
        assert redact_url(url) == url
    assert "PW" not in redact_url(b"redis://:PW@h")  # not a str: its repr, redacted
    assert redact_url(42) == "42"


def test_redact_text_masks_a_password_that_a_client_library_echoes():
    from storage_backends.credentials import redact_text

    url = "redis://:PA%2FSS@h:1/0"
    msg = f"could not connect to {url} with password PA/SS (PA%2FSS)"
    shown = redact_text(msg, url)
    assert "PA" not in shown and "SS" not in shown and "could not connect to redis://:***@h:1/0" in shown


def bad_store_urls(rnd: random.Random, n: int):
    """(url, password): URLs a typo in a Secret makes (unescaped reserved characters, a missing ':', a
    wrong scheme, bad options)."""
    for _ in range(n):
        pw = password(rnd)
        host = f"127.0.0.1:{rnd.randint(1, 65535)}"
        url = rnd.choice(
            [
                f"redis://:{pw}@{host}/0",
                f"redis://user:{pw}@{host}/0",
                f"redis//:{pw}@{host}/0",
                f"redis:/:{pw}@{host}/0",
                f"memcached://:{pw}@{host}",
                f"redis://:{quote(pw, safe='')}@{host}/0?bogus=1",
                f"redis://:{quote(pw, safe='')}@{host}/notadb@x",
                f"s3://{pw}@bucket/prefix",
                f"s3://bucket/p?endpoint_url=http://u:{pw}@{host}&bogus=1",
                f"nixl://:{pw}@{host}",
                f"nixl://{host}?token={pw}",
                f"local://x?password={pw}&bogus=1",
            ]
        )
        yield url, pw


def test_store_url_errors_and_reprs_never_show_the_password(caplog):
    """Every constructor either refuses the URL (ValueError) or builds a backend: neither the message
    nor the repr nor any log line holds a piece of the password."""
    rnd = random.Random(99)
    refused = built = 0
    with caplog.at_level(logging.DEBUG):
        for url, pw in bad_store_urls(rnd, 400):
            try:
                backend = open_backend(url)
            except ValueError as e:
                assert not leaks(str(e), pw), (url, str(e))
                refused += 1
                continue
            assert not leaks(repr(backend) + backend.url, pw), (url, repr(backend))
            built += 1
            logs = " ".join(r.getMessage() for r in caplog.records)
            assert not leaks(logs, pw), (url, logs)
    assert refused > 100 and built > 10  # both paths were exercised


def test_redis_store_down_message_and_log_hide_the_password(caplog):
    if not has_module("redis"):
        pytest.skip("python package 'redis' is not installed")
    pw = "SE/CR#ET?P@SS"
    url = f"redis://app:{quote(pw, safe='')}@127.0.0.1:{closed_port()}/0"

    async def go():
        b = open_backend(url, timeout_s=1, connect_timeout_s=0.5)
        with pytest.raises(StoreError) as e:
            await b.get("k")
        await b.close()
        return str(e.value), repr(b)

    with caplog.at_level(logging.DEBUG):
        msg, shown = run(go(), timeout=30)
    for text in (msg, shown, *(r.getMessage() for r in caplog.records)):
        assert "SE" not in text and "CR" not in text and "%2F" not in text, text
    assert "redis://***@127.0.0.1" in msg


def test_dual_store_repr_hides_password_and_mac_key():
    from storage_backends import DualCopyStore

    s = DualCopyStore("redis://:TOPSECRET@127.0.0.1:1/0", "m", "float16", mac_key=b"K" * 32)
    assert "TOPSECRET" not in repr(s) and "KKKK" not in repr(s) and "mac" in repr(s)
    assert "KKKK" not in repr(s._mac)


# -- reading secrets --------------------------------------------------------------------------------


def test_secret_from_env_reads_a_file_or_the_value_and_refuses_both(tmp_path):
    from storage_backends import read_secret_file, secret_from_env

    f = tmp_path / "key"
    f.write_bytes(b"from-the-file-0123456789\n")
    assert secret_from_env("X", {"X_FILE": str(f)}) == b"from-the-file-0123456789"
    assert secret_from_env("X", {"X": "from-env"}) == b"from-env"
    assert secret_from_env("X", {}) is None
    with pytest.raises(ValueError, match="not both"):
        secret_from_env("X", {"X_FILE": str(f), "X": "v"})
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret_file(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read") as e:
        read_secret_file(tmp_path / "missing", "MAC key")
    assert str(tmp_path / "missing") in str(e.value)


def test_mac_key_is_checked_and_never_shown():
    from storage_backends import Mac

    with pytest.raises(ValueError, match="at least 16") as e:
        Mac(b"SHORTKEY")
    assert "SHORTKEY" not in str(e.value)
    mac = Mac(b"A" * 16)
    assert "AAAA" not in repr(mac)
    tag = mac.tag(b"x", b"y")
    assert mac.verify(tag, b"x", b"y") and not mac.verify(tag, b"xy") and not mac.verify(tag, b"x", b"z")
    assert not Mac(b"B" * 16).verify(tag, b"x", b"y")
    assert not mac.verify("é" * 64, b"x", b"y") and not mac.verify(None, b"x", b"y")


# -- the configs that carry the URL (RemoteCacheConfig, kv_connector_extra_config) --------------------


def test_remote_cache_config_errors_and_repr_hide_the_password():
    from vericache_connector.store.config import RemoteCacheConfig

    cfg = RemoteCacheConfig(url="redis://:TOPSECRET@h:6379/0")
    assert "TOPSECRET" not in repr(cfg)
    for url in ("memcached://:TOPSECRET@h:1", "redis://:TOP/SECRET@h:1/0?timeout_s=3"):
        with pytest.raises(ValueError) as e:
            RemoteCacheConfig(url=url)
        assert "TOP" not in str(e.value)


def test_connector_config_errors_hide_the_password():
    from vericache_connector.integration.vllm.connector.config import load_connector_config

    with pytest.raises(ValueError) as e:
        load_connector_config({}, {"VERICACHE_STORE_URL": "memcached://:TOPSECRET@cache:11211"})
    assert "TOPSECRET" not in str(e.value)
