"""Rebuild the chat-formatted prompts of this folder (run once; the JSON files are committed).

    python vericache_connector/data/prompts/chat/build_chat_prompts.py

Documents come from CPython 3.11.7's standard library (Python Software Foundation License, see
../psf_license.txt): pydoc_data/topics.py (the language and library reference topics) and the sources of
textwrap.py, shlex.py and string.py. Questions, tool definitions, the assistant turn and the inventory
table are written for this repository (generated below from a fixed seed), under the repository's license.
"""

from __future__ import annotations

import inspect
import json
import pydoc_data.topics as topics
import random
import shlex
import string
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPERT = "You are a precise Python expert. Answer from the documentation the user gives you."


def doc(*names: str) -> str:
    return "\n\n".join(topics.topics[n].strip() for n in names)


def inventory(rows: int = 150, seed: int = 15) -> str:
    """A CSV inventory snapshot (synthetic)."""
    rng = random.Random(seed)
    parts = ["bolt", "washer", "bracket", "hinge", "gasket", "spring", "valve", "bearing", "pulley", "clamp"]
    sizes = ["M4", "M5", "M6", "M8", "M10", "M12", "1/4in", "3/8in"]
    lines = ["sku,name,warehouse,stock,reorder_level,unit_cost_usd"]
    for i in range(rows):
        name = f"{rng.choice(sizes)} {rng.choice(['steel', 'brass', 'nylon', 'zinc'])} {rng.choice(parts)}"
        level = rng.choice([20, 50, 100, 200])
        stock = max(0, int(level * rng.uniform(0.2, 3.0)))
        lines.append(f"SKU-{1000 + i},{name},{rng.choice('ABC')},{stock},{level},{rng.uniform(0.05, 9.0):.2f}")
    return "\n".join(lines)


TOOLS = [
    {
        "name": "create_purchase_order",
        "description": "Order more units of an item for one warehouse.",
        "parameters": {
            "type": "object",
            "properties": {
                "sku": {"type": "string"},
                "quantity": {"type": "integer", "minimum": 1},
                "warehouse": {"type": "string", "enum": ["A", "B", "C"]},
            },
            "required": ["sku", "quantity", "warehouse"],
        },
    },
    {
        "name": "transfer_stock",
        "description": "Move units of an item between warehouses.",
        "parameters": {
            "type": "object",
            "properties": {
                "sku": {"type": "string"},
                "from_warehouse": {"type": "string"},
                "to_warehouse": {"type": "string"},
                "quantity": {"type": "integer", "minimum": 1},
            },
            "required": ["sku", "from_warehouse", "to_warehouse", "quantity"],
        },
    },
    {
        "name": "notify",
        "description": "Send a short message to a team.",
        "parameters": {
            "type": "object",
            "properties": {"team": {"type": "string"}, "message": {"type": "string"}},
            "required": ["team", "message"],
        },
    },
]


def prompts() -> dict[str, dict]:
    return {
        "chat_customization_qa": {
            "kind": "chat: question over a long document",
            "source": "pydoc_data/topics.py: customization, typesmapping (PSF)",
            "messages": [
                {"role": "system", "content": EXPERT},
                {
                    "role": "user",
                    "content": "Documentation:\n\n"
                    + doc("customization", "typesmapping")
                    + "\n\nQuestion: a class defines __eq__ but not __hash__. What happens when its instances are "
                    "used as dictionary keys or set members, and how should the class be fixed if its "
                    "instances are immutable? Explain step by step, quoting the documentation.",
                },
            ],
        },
        "chat_formatstrings_qa": {
            "kind": "chat: question over a long document",
            "source": "pydoc_data/topics.py: formatstrings (PSF)",
            "messages": [
                {"role": "system", "content": EXPERT},
                {
                    "role": "user",
                    "content": doc("formatstrings")
                    + "\n\nUsing the format specification mini-language above, give the format strings for: "
                    "(a) a float with a thousands separator and two decimals, right-aligned in 15 characters; "
                    "(b) an integer in binary, zero-padded to 16 digits; (c) a ratio as a percentage with one "
                    "decimal. Explain every field of each specification.",
                },
            ],
        },
        "chat_debugger_multiturn": {
            "kind": "chat: multi-turn conversation over a long document",
            "source": "pydoc_data/topics.py: debugger (PSF); the assistant turn written here",
            "messages": [
                {"role": "system", "content": EXPERT},
                {
                    "role": "user",
                    "content": "Here is the pdb documentation:\n\n"
                    + doc("debugger")
                    + "\n\nHow do I set a breakpoint that only stops when the variable x is greater than 10?",
                },
                {
                    "role": "assistant",
                    "content": "Give the breakpoint a condition: `break myfile.py:42, x > 10` (or `b 42, x > 10` "
                    "in the current file). The condition is evaluated each time the line is reached and pdb "
                    "only stops when it is true. You can add or change the condition of an existing "
                    "breakpoint later with `condition <bpnumber> x > 10`.",
                },
                {
                    "role": "user",
                    "content": "Good. Now how do I make pdb print x and the call stack automatically every time "
                    "that breakpoint is hit, and then continue running without waiting for me?",
                },
            ],
        },
        "chat_tool_call_inventory": {
            "kind": "chat: tool call, JSON output over a long table",
            "source": "written here: tool definitions and a synthetic inventory table (seed 15)",
            "messages": [
                {
                    "role": "system",
                    "content": "You are an inventory agent. You can call these tools:\n"
                    + json.dumps(TOOLS, indent=1)
                    + '\nAnswer ONLY with a JSON array of tool calls, each {"name": ..., "arguments": {...}}.',
                },
                {
                    "role": "user",
                    "content": "Inventory snapshot:\n"
                    + inventory()
                    + "\n\nFor every item in warehouse B whose stock is below its reorder level, create a "
                    "purchase order for twice the reorder level minus the stock. Then notify the team "
                    '"purchasing" with the list of SKUs ordered.',
                },
            ],
        },
        "chat_json_extract_shlex": {
            "kind": "chat: JSON extraction over source code",
            "source": "shlex.py and string.py (PSF)",
            "messages": [
                {
                    "role": "user",
                    "content": "```python\n# shlex.py\n"
                    + inspect.getsource(shlex)
                    + "\n# string.py\n"
                    + inspect.getsource(string)
                    + "```\nDescribe these two modules as JSON: "
                    '{"modules": [{"module": str, "classes": [{"name": str, "bases": [str], "methods": [str]}], '
                    '"functions": [str]}]}. Output only the JSON object.',
                },
            ],
        },
        "chat_code_textwrap": {
            "kind": "chat: code generation with a long source file as context",
            "source": "textwrap.py (PSF)",
            "messages": [
                {"role": "system", "content": "You are a senior Python developer. Reply with code only."},
                {
                    "role": "user",
                    "content": "Here is textwrap.py from the standard library:\n```python\n"
                    + inspect.getsource(textwrap)
                    + "```\nUsing TextWrapper, write `format_columns(rows: list[tuple[str, str]], width: int) "
                    "-> str`: each row is a term and its description; the term is printed in a left column "
                    "of fixed width and the description wraps in the right column, its continuation lines "
                    "indented under the first. Add type hints, a docstring and a doctest.",
                },
            ],
        },
    }


def main() -> None:
    if sys.version_info[:3] != (3, 11, 7):
        print(f"warning: built from Python {sys.version.split()[0]}, the committed files from 3.11.7")
    for name, p in prompts().items():
        (HERE / f"{name}.json").write_text(json.dumps({"name": name, **p}, indent=1, ensure_ascii=False) + "\n")
        print(name)


if __name__ == "__main__":
    main()
