"""The router's OpenAI side: which requests it drafts for, read strictly, and the answers it shapes.

A drafted request is answered by the router itself, so it must read every field as vLLM's own request
models would and refuse what vLLM refuses. It does not re-implement vLLM's validation: `parse` accepts a
body for drafting only when every field is one a drafted request may carry, of exactly the JSON type and
in the range vLLM accepts (a bool is true or false, not "false"; max_tokens an integer >= 1; token ids in
the vocabulary; text that is valid UTF-8), and the sampling options that do not change greedy decoding at
their neutral values. Anything else, malformed or merely unusual, is passed to a verifier as it came,
whose answer (vLLM's own status and message for a bad field, plain decoding otherwise) goes back as is.
Reading too strictly costs only speed; reading more leniently than vLLM would answer what vLLM refuses.

Answers: `Reply` shapes the chunks of a streamed answer and the body of a whole one as vLLM's server
does; `Text` detokenizes incrementally as vLLM's detokenizer does: after the prompt, holding back (and at
the end dropping) a token whose text ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

GREEDY_EPS = 1e-5  # vLLM's: a temperature below it is greedy
INT64 = (-(1 << 63), (1 << 63) - 1)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# sampling options greedy decoding ignores or that must be neutral for it: drafted only at these values
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
IGNORED_WHEN_GREEDY = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,)}


def _is_bool(v) -> bool:
    return type(v) is bool


def _is_int(v, lo=INT64[0], hi=INT64[1]) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_text(v) -> bool:
    if type(v) is not str:
        return False
    try:
        v.encode("utf-8")  # a lone surrogate does not encode: vLLM's business, not ours
    except UnicodeEncodeError:
        return False
    return True


def _is_message(m) -> bool:
    if type(m) is not dict or set(m) - {"role", "content", "name"} or not _is_text(m.get("role")):
        return False
    content = m.get("content")
    parts = content if type(content) is list else [{"type": "text", "text": content}]
    return all(type(p) is dict and set(p) == {"type", "text"} and p["type"] == "text" and _is_text(p["text"])
               for p in parts) and m["role"] in ("system", "user", "assistant")  # fmt: skip


CHECKS = {  # field -> the values a drafted request may carry (None is "absent" for every field but these)
    "model": lambda v: v is None or _is_text(v),
    "max_tokens": lambda v: v is None or _is_int(v, 1),
    "max_completion_tokens": lambda v: v is None or _is_int(v, 1),
    "temperature": lambda v: _is_number(v) and 0 <= v < GREEDY_EPS,
    "n": lambda v: v is None or v == 1 and type(v) is int,
    "seed": lambda v: v is None or _is_int(v),
    "user": lambda v: v is None or _is_text(v),
    "request_id": _is_text,
    "stream_options": lambda v: (
        v is None
        or (
            type(v) is dict and set(v) <= {"include_usage", "continuous_usage_stats"} and all(map(_is_bool, v.values()))
        )
    ),  # fmt: skip
    "chat_template_kwargs": lambda v: v is None or type(v) is dict and all(map(_is_text, v)),
    **{k: _is_bool for k in ("stream", "ignore_eos", "return_token_ids", "add_special_tokens")},
    **{k: _is_bool for k in ("add_generation_prompt", "continue_final_message")},
    **{k: (lambda ok: lambda v: v is None or (_is_number(v) and v in ok))(ok) for k, ok in IGNORED_WHEN_GREEDY.items()},
    **{k: (lambda x: lambda v: v is None or (_is_number(v) and v == x))(x) for k, x in NEUTRAL.items()},
}
SHARED = {"model", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos", "return_token_ids", "user"}
SHARED |= {"n", "seed", "request_id", *IGNORED_WHEN_GREEDY, *NEUTRAL}
SPECULATED = {  # the fields a drafted request may carry (anything else: passed to a verifier as it came)
    COMPLETIONS: SHARED | {"prompt", "add_special_tokens"},
    CHAT: SHARED
    | {"messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"},
}


@dataclass
class Parsed:
    """A request the router drafts for, as vLLM reads it."""

    chat: bool
    max_tokens: int | None  # None: vLLM's default (16 on completions, the rest of the context on chat)
    stream: bool = False
    ignore_eos: bool = False
    with_ids: bool = False  # return_token_ids
    include_usage: bool = False
    prompt_ids: list[int] | None = None  # given as token ids
    tokenize: dict | None = None  # else: what the verifier's /tokenize is asked


def parse(path: str, body: dict, defaults: dict, vocab: int) -> Parsed | None:
    """The request for drafting, or None: pass it on (module docstring). `defaults`: the served model's
    generation-config sampling defaults (a penalty set there applies to requests that leave it out);
    `vocab`: token ids must be below it."""
    body = {k: v for k, v in body.items() if v is not None or k in ("max_tokens", "max_completion_tokens")}
    if set(body) - SPECULATED[path] or "temperature" not in body:  # null is absent (vLLM: its default)
        return None
    if not all(CHECKS[k](v) for k, v in body.items() if k not in ("prompt", "messages")):  # read below
        return None
    if any(k not in body and not CHECKS[k](v) for k, v in defaults.items() if k in CHECKS):
        return None
    stream = body.get("stream", False)
    if body.get("stream_options") is not None and not stream:  # vLLM: stream options need stream=true
        return None
    chat = path == CHAT
    limit = body.get("max_completion_tokens") if chat else None
    out = Parsed(
        chat,
        limit if limit is not None else body.get("max_tokens"),
        stream,
        body.get("ignore_eos", False),
        body.get("return_token_ids", False),
        bool((body.get("stream_options") or {}).get("include_usage")),
    )
    if chat:
        messages = body.get("messages")
        if type(messages) is not list or not messages or not all(map(_is_message, messages)):
            return None
        if body.get("add_generation_prompt") and body.get("continue_final_message"):
            return None
        keys = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
        out.tokenize = {k: body[k] for k in keys if body.get(k) is not None}
        return out
    prompt = body.get("prompt")
    if type(prompt) is list and prompt and all(_is_int(t, 0, vocab - 1) for t in prompt):
        out.prompt_ids = prompt
    elif _is_text(prompt) and prompt:
        out.tokenize = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    else:
        return None
    return out


class Text:
    """Incremental detokenization as vLLM's detokenizer does it (its fast path, tokenizers' DecodeStream):
    each token is decoded after the text before it (the prompt, at first), and a token's whole text is held
    back while the decoded text ends in an incomplete UTF-8 sequence (U+FFFD); it comes out with the token
    that completes the character, or never: an answer that ends inside a character ends without it.

    `prompt`: the prompt's token ids. A tokenizer with a Rust backend is decoded through it, as vLLM does
    (no clean-up of tokenization spaces); one with only `decode` through that."""

    def __init__(self, tokenizer, prompt: list[int] = ()):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.decoder = backend if backend is not None else tokenizer
        self.text = ""  # the answer's text so far
        # the ids the next token is decoded after (the prompt's at first, then those whose text came out
        # last, and any held back since); `shown`: what the first `cut` of them decode to, the part of the
        # next decoding that is not new
        self.window, self.shown, self.cut = list(prompt), "", 0

    def add(self, ids: list[int]) -> str:
        delta = "".join(map(self._step, ids))
        self.text += delta
        return delta

    def _step(self, token: int) -> str:
        try:
            return self._next(token)
        except _Misread:  # vLLM: a fresh stream, without the text before (its "invalid prefix" recovery)
            self.window, self.shown, self.cut = [], "", 0
            return self._next(token)

    def _next(self, token: int) -> str:
        if not self.shown and self.window:  # no text before yet: the window's, unless it ends inside a character
            before = self._decode(self.window)
            if not before.endswith("\ufffd"):
                self.shown, self.cut = before, len(self.window)
        self.window.append(token)
        now = self._decode(self.window)
        if len(now.encode()) <= len(self.shown.encode()) or now.endswith("\ufffd"):
            return ""  # nothing new yet, or it ends inside a character: held back
        if not now.startswith(self.shown):
            raise _Misread
        new = now[len(self.shown) :]
        # the next token is decoded after the ids added since the last text came out
        self.window, self.cut = self.window[self.cut :], len(self.window) - self.cut
        self.shown = self._decode(self.window)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=True)


class _Misread(Exception):
    """The text before the new token decodes differently with it (vLLM resets its stream then)."""


class Reply:
    """One answer's OpenAI shape: completions or chat, streamed chunks or one body."""

    def __init__(self, rid: str, created: int, model: str, req: Parsed):
        self.rid, self.created, self.model, self.req = rid, created, model, req
        self.object = "chat.completion.chunk" if req.chat else "text_completion"

    def chunk(self, delta: str, new: list[int], finish: str | None, first: bool = False) -> dict:
        if self.req.chat:
            d = ({"role": "assistant"} if first else {}) | ({"content": delta} if delta or first else {})
            c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if self.req.with_ids:
            c["token_ids"] = new
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model, "choices": [c]}

    def whole(self, text: str, tokens: list[int], finish: str, usage: dict) -> dict:
        if self.req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if self.req.with_ids:
            choice["token_ids"] = tokens
        obj = "chat.completion" if self.req.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage}  # fmt: skip


def error_body(message: str, status: int, kind: str = "BadRequestError") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
