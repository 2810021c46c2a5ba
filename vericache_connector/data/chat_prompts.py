"""Chat-formatted prompts (prompts/chat/*.json): questions over long documents, a multi-turn
conversation, a tool call and a JSON extraction with JSON answers, and code generation.

Each file holds {"name", "kind", "source", "messages": [{"role", "content"}, ...]}; the prompt text is
the messages through the model's own chat template with the generation prompt added (the model then
writes the assistant's answer). They are kept apart from the plain-text prompts of prompts/*.txt
(load_prompts), which the tests' shared fixtures prefill, so those stay as they are.
Sources and licenses: prompts/SOURCES.md; prompts/chat/build_chat_prompts.py rebuilds the files.
"""

from __future__ import annotations

import json
from importlib import resources


def _folder():
    return resources.files(__package__).joinpath("prompts", "chat")


def chat_prompt_names() -> list[str]:
    return sorted(f.name.removesuffix(".json") for f in _folder().iterdir() if f.name.endswith(".json"))


def load_chat_prompt(name: str) -> dict:
    """The prompt's JSON document ({"name", "kind", "source", "messages"})."""
    names = chat_prompt_names()
    if name not in names:
        raise ValueError(f"unknown chat prompt {name!r}; known: {', '.join(names)}")
    return json.loads(_folder().joinpath(f"{name}.json").read_text())


def render_chat_prompt(name: str, tokenizer) -> str:
    """The prompt text: its messages through `tokenizer`'s chat template, generation prompt added."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"chat prompt {name!r} needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(load_chat_prompt(name)["messages"], add_generation_prompt=True, tokenize=False)


def load_any_prompt(name: str, tokenizer=None) -> str:
    """A plain-text bundled prompt (prompts/<name>.txt) or a chat prompt rendered with `tokenizer`."""
    from . import load_prompt, prompt_names

    if name in prompt_names():
        return load_prompt(name)
    if name in chat_prompt_names():
        return render_chat_prompt(name, tokenizer)
    raise ValueError(f"unknown prompt {name!r}; known: {', '.join(prompt_names() + chat_prompt_names())}")
