"""Bad input gives one clear error line naming the bad value (exit 2, no traceback); the demo runs."""

from __future__ import annotations

import json

import pytest

from vericache_connector.cli import main


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--compressor", "zip9"], "'zip9'"),
        (["--compressor", "snapkv:ratio=0.25"], "0.25"),
        (["--compressor", "kivi:bits=7"], "7"),
        (["--draft-k", "0"], "draft_k=0"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--prompt", "war_and_peace"], "'war_and_peace'"),
    ],
)
def test_bad_input_is_one_clear_error(capsys, args, needle):
    assert main(["demo", "--single", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.startswith("vericache: error:")


@pytest.mark.slow
def test_empty_and_too_long_prompts(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    assert main(["demo", "--single", "--prompt-file", str(empty)]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    assert main(["demo", "--single", "--prompt-file", str(long)]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 8192 tokens" in err and "9001 tokens" in err


@pytest.mark.slow
def test_demo_json(capsys):
    rc = main(
        [
            "demo",
            "--single",
            "--prompt",
            "graphlib_py",
            "--compressor",
            "snapkv-4x",
            "--max-new-tokens",
            "24",
            "--draft-k",
            "8",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["identical"] is True
    assert report["new_tokens"] == 24 and report["prompt_tokens"] == 1886
    assert 0.2 < report["compressed_bytes"] / report["full_bytes"] < 0.3
    assert report["mean_accepted_per_verification"] > 0


def test_single_demo_options_need_single(capsys):
    assert main(["demo", "--prompt", "graphlib_py"]) == 2
    assert "--prompt applies to the single-prompt demo only: add --single" in capsys.readouterr().err


@pytest.mark.slow
def test_serving_demo_json(capsys):
    """The default demo: a small trace under a budget, three policies, VeriCache identical to full KV."""
    rc = main(
        ["demo", "--requests", "3", "--prompt-tokens", "700", "--max-new-tokens", "12", "--budget", "0.4", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["identical"] is True
    rows = {r["policy"]: r for r in report["rows"]}
    assert set(rows) == {"full", "lossy", "vericache"}
    assert rows["vericache"]["identical"] == rows["full"]["identical"] == 3
    assert rows["vericache"]["max_rows"] > rows["full"]["max_rows"]  # the budget holds more compressed rows
    assert report["prompt_tokens"] == [700, 700, 700] and report["new_tokens"] == 12
