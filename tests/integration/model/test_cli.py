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


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt-file", "x.txt"], "--prompt-file applies to the single-prompt demo (--single) only, not to the "
         "shared-prefix demo (the default)"),
        (["--requests", "3"], "--requests applies to the serving demo (--serving) only, not to the shared-prefix"),
        (["--serving", "--rounds", "3"], "--rounds applies to the shared-prefix demo (the default) only, not to the "
         "serving demo (--serving)"),
        (["--single", "--link-mb-s", "5", "--no-pin"], "--link-mb-s applies to the shared-prefix demo (the default) "
         "only; --no-pin applies to the shared-prefix demo (the default) only, not to the single-prompt demo"),
        (["--serving", "--single"], "not allowed with argument"),
    ],
)  # fmt: skip
def test_demo_options_of_another_demo_are_errors(capsys, args, needle):
    """An option of another demo is an error naming it, not silently ignored."""
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("vericache: error:")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--rounds", "0"], "rounds must be an integer >= 1, got 0"),
        (["--link-mb-s", "nan"], "link_mb_s must be a finite number > 0, got nan"),
        (["--link-mb-s", "0"], "link_mb_s must be a finite number > 0, got 0.0"),
        (["--prompt", "war_and_peace"], "'war_and_peace'"),
        (["--compressor", "zip9"], "'zip9'"),
        (["--prompt-tokens", "200"], "a prompt of 200 tokens stores nothing: it needs more than 256 tokens"),
    ],
)
def test_shared_prefix_demo_bad_input_before_any_process(capsys, args, needle):
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.startswith("vericache: error:")


@pytest.mark.slow
def test_serving_demo_json(capsys):
    """--serving: a small trace under a budget, three policies, VeriCache identical to full KV."""
    rc = main(
        [
            "demo",
            "--serving",
            "--requests",
            "3",
            "--prompt-tokens",
            "700",
            "--max-new-tokens",
            "12",
            "--budget",
            "0.4",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["identical"] is True
    rows = {r["policy"]: r for r in report["rows"]}
    assert set(rows) == {"full", "lossy", "vericache"}
    assert rows["vericache"]["identical"] == rows["full"]["identical"] == 3
    assert rows["vericache"]["max_rows"] > rows["full"]["max_rows"]  # the budget holds more compressed rows
    assert report["prompt_tokens"] == [700, 700, 700] and report["new_tokens"] == 12


@pytest.mark.slow
def test_shared_prefix_demo(capsys, engine):
    """The default demo's short variant (the README shows it): node A stores a prefix, node B serves it four
    ways over the emulated link, node A two ways beside the store; every way's line says identical and how it
    was served, and the reference continuation is the session engine's own full-KV greedy output."""
    from vericache_connector.data import load_prompt
    from vericache_connector.demo.shared_prefix_report import LABELS
    from vericache_connector.engine import DecodeConfig

    rc = main(["demo", "--rounds", "1", "--prompt-tokens", "300", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    served = {"recompute": "recompute 1/1", "full-kv": "fetch 1/1", "local": "hit 1/1", "verified": "verified 1/1"}
    for way, label in LABELS.items():
        (line,) = [x for x in lines if x.startswith(label)]
        assert "  yes 1/1  " in line and line.endswith(served[way]), line
    assert "(2): the full copy arrived after" in out and "fetch / decode" in out
    assert "full-copy bytes over the link: 0" in out  # (4): only the compressed copy crossed the slow link
    assert "emulated link: node B reads the store at 11 MB/s" in out
    assert "prompt graphlib_py: 300 tokens, 256 stored (whole chunks of 256); 8 new tokens" in out
    assert "identical to full-KV greedy: yes" in out  # node A's miss
    (fast,) = [x for x in lines if x.startswith("node A, beside the store")]
    assert fast.endswith("identical yes 2/2"), fast
    assert "every output identical to full-KV greedy: yes (7/7;" in out
    ids = engine.encode(load_prompt("graphlib_py"))[:300]
    ref = engine.generate_full([engine.prefill(ids)], DecodeConfig(max_new_tokens=8, stop_at_eos=False))[0]
    assert f"full-KV greedy continuation (every way): {engine.tokenizer.decode(ref)!r}" in out
