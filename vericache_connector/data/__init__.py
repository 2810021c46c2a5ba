"""The bundled real prompts (long texts from the CPython standard library, see prompts/SOURCES.md)."""

from __future__ import annotations

from importlib import resources


def prompt_names() -> list[str]:
    files = resources.files(__package__).joinpath("prompts")
    return sorted(f.name.removesuffix(".txt") for f in files.iterdir() if f.name.endswith(".txt"))


def load_prompt(name: str) -> str:
    names = prompt_names()
    if name not in names:
        raise ValueError(f"unknown bundled prompt {name!r}; known: {', '.join(names)}")
    return resources.files(__package__).joinpath("prompts", f"{name}.txt").read_text()


def load_prompts() -> dict[str, str]:
    """All bundled prompts, shortest first."""
    texts = {n: load_prompt(n) for n in prompt_names()}
    return dict(sorted(texts.items(), key=lambda kv: len(kv[1])))


def load_long_documents() -> dict[str, str]:
    """The long documents (prompts/long/: whole CPython 3.11.7 source files of 6.5-7.4k tokens, near the bundled
    model's 8k context), by name, shortest first: the long-context workload's documents. Not among
    load_prompts(), which the demo and the exactness tests decode whole."""
    files = resources.files(__package__).joinpath("prompts", "long")
    texts = {f.name.removesuffix(".txt"): f.read_text() for f in files.iterdir() if f.name.endswith(".txt")}
    return dict(sorted(texts.items(), key=lambda kv: len(kv[1])))
