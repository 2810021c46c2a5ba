"""Secrets of the storage layer: one redaction for every message, repr and log line that can hold a store
URL, secrets read from mounted files or the environment (never from argv), and the keyed MAC.

``redact_url`` never trusts the URL to be well formed: a password holding an unescaped ``/``, ``#``, ``?``
or ``@`` (a typo in a Kubernetes Secret) ends the authority early for ``urlsplit``, so everything up to
the LAST ``@`` after the scheme is treated as user info, and a credential-like query option is masked to
the end of the URL. Over-redacting a URL whose path or query holds an ``@`` is the price: a message may
lose a few characters, a secret never prints.

Keys and tokens come from ``NAME_FILE`` (the path of a mounted Secret file: preferred) or ``NAME`` (the
value, from a ``secretKeyRef``): see ``secret_from_env``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import Mapping
from urllib.parse import quote, unquote

MASK = "***"
# a scheme and the slashes after it, also when mistyped ("redis//", "redis:/")
_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(?::/*|/+)")
# query options whose value is a credential (password=..., aws_secret_access_key=..., token=..., sig=...)
_SECRET_OPTION = re.compile(r"[?&;][\w.\-]*(?:pass|pwd|secret|token|key|auth|cred|sig)[\w.\-]*=", re.IGNORECASE)
MIN_KEY_BYTES = 16
MAC_ALGO = "blake2b-mac"  # the checksum algorithm name of entries written with a MAC key


def _split_userinfo(url: str) -> tuple[str, str | None, str]:
    """(scheme prefix, user info or None, the rest after the last '@')."""
    m = _PREFIX.match(url)
    prefix = m.group(0) if m else ""
    rest = url[len(prefix) :]
    if "@" not in rest:
        return prefix, None, rest
    userinfo, _, tail = rest.rpartition("@")
    return prefix, userinfo, tail


def redact_url(url) -> str:
    """The URL with its password replaced by ***, for messages.

    'redis://:s3cret@h:6379/0' -> 'redis://:***@h:6379/0'; a user name is masked with the password, since
    a typo ('redis://pass:word@h') can make part of a password look like one: 'rediss://app:pw@h' ->
    'rediss://***@h', 'redis://tok@h' -> 'redis://***@h'. The value of a
    credential-like query option (password=, token=, *secret*=, *key*=, ...) is masked to the end of the
    URL, since an unescaped '&' or '#' in it would otherwise end it early. Anything that is not a str is
    shown by its repr, redacted the same way.
    """
    text = url if isinstance(url, str) else repr(url)
    masked = bytearray(len(text))  # 1 where a character is secret
    m = _PREFIX.match(text)
    start = m.end() if m else 0
    at = text.rfind("@")
    if at > start:  # user info: all of it, but the ':' of an empty user name (a typo can put a secret anywhere)
        keep = 1 if text[start] == ":" and at > start + 1 else 0
        masked[start + keep : at] = b"\x01" * (at - start - keep)
    option = _SECRET_OPTION.search(text)
    if option is not None:
        masked[option.end() :] = b"\x01" * (len(text) - option.end())
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and masked[j] == masked[i]:
            j += 1
        out.append(MASK if masked[i] else text[i:j])
        i = j
    return "".join(out)


def url_secrets(url) -> list[str]:
    """The secret parts of a URL (password, or user info without ':'), raw, decoded and encoded."""
    if not isinstance(url, str):
        return []
    _, userinfo, _ = _split_userinfo(url)
    if not userinfo:
        return []
    user, colon, password = userinfo.partition(":")
    secret = password if colon else user
    return sorted({s for s in (secret, unquote(secret), quote(secret, safe="")) if s}, key=len, reverse=True)


def has_password(url) -> bool:
    """Whether the URL carries a password (user info with one, or a credential-like query option)."""
    if not isinstance(url, str):
        return False
    _, userinfo, _ = _split_userinfo(url)
    return bool(userinfo and userinfo.partition(":")[2]) or _SECRET_OPTION.search(url) is not None


def with_password(url: str, password: str) -> str:
    """The URL with `password` (percent-encoded) as its user info's password: 'redis://h:6379/0' ->
    'redis://:pw@h:6379/0', 'redis://app@h/0' -> 'redis://app:pw@h/0'. ValueError where it has one already."""
    if has_password(url):
        raise ValueError(f"store URL {redact_url(url)} has a password already: give it one way, not two")
    prefix, userinfo, rest = _split_userinfo(url)
    return f"{prefix}{userinfo or ''}:{quote(password, safe='')}@{rest}"


def redact_text(text: str, url) -> str:
    """text with every occurrence of url's secret (and of url itself) masked: for messages that
    client libraries build, which we do not control."""
    text = str(text)
    if isinstance(url, str) and url:
        text = text.replace(url, redact_url(url))
    for secret in url_secrets(url):
        text = text.replace(secret, MASK)
    return text


# ---------------------------------------------------------------- reading secrets
def read_secret_file(path: str | os.PathLike, what: str = "secret") -> bytes:
    """The bytes of a mounted secret file, trailing newline/whitespace stripped. ValueError names the
    path (never the content) when it is unreadable or empty."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {str(path)!r}: {e.strerror or type(e).__name__}") from None
    data = data.rstrip(b"\r\n\t ")
    if not data:
        raise ValueError(f"the {what} file {str(path)!r} is empty")
    return data


def secret_from_env(name: str, env: Mapping[str, str] | None = None, what: str | None = None) -> bytes | None:
    """A secret from ``{name}_FILE`` (a path: a mounted Kubernetes Secret) or ``{name}`` (the value);
    None when neither is set. Both set is an error (which one would win is a guess)."""
    env = os.environ if env is None else env
    what = what or name
    path, value = env.get(f"{name}_FILE"), env.get(name)
    if path and value:
        raise ValueError(f"set one of {name}_FILE and {name}, not both")
    if path:
        return read_secret_file(path, what)
    if value:
        return value.encode()
    return None


# ---------------------------------------------------------------- keyed MAC
class Mac:
    """Keyed BLAKE2b tags over byte strings. The key is derived from the secret given (>= 16 bytes) for
    one purpose (``person``), so one Secret can key several uses; it never appears in a repr."""

    def __init__(self, secret: bytes | str, person: bytes = b"vericache-mac"):
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)):
            raise ValueError(f"a MAC key must be bytes, got {type(secret).__name__}")
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a MAC key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._key = hashlib.blake2b(bytes(secret), digest_size=32, person=person[:16]).digest()

    def tag(self, *parts: bytes | memoryview, size: int = 32) -> str:
        """Hex tag over the parts (each length-prefixed, so the split between them is bound too)."""
        h = hashlib.blake2b(key=self._key, digest_size=size)
        for p in parts:
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.hexdigest()

    def hasher(self, length: int, size: int = 32):
        """A hashlib object that, fed one part of `length` bytes in pieces (update, in order), ends at
        tag(part, size=size): for a payload that arrives in ranges."""
        h = hashlib.blake2b(key=self._key, digest_size=size)
        h.update(length.to_bytes(8, "little"))
        return h

    def verify(self, tag, *parts: bytes | memoryview) -> bool:
        if not isinstance(tag, str) or not tag.isascii() or len(tag) not in (32, 64):
            return False
        return hmac.compare_digest(tag, self.tag(*parts, size=len(tag) // 2))

    def __repr__(self) -> str:
        return f"<Mac key={MASK}>"


def mac_from(secret: bytes | str | None) -> Mac | None:
    return None if secret is None else Mac(secret)
