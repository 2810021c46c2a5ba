"""Every failure of the CLI is one `vericache: error: ...` line and exit status 2 (1 means "output not
identical"): bad numbers (NaN temperature), argparse's own errors, and model folders that do not load
(a bare or broken config, junk or mismatched safetensors, no tokenizer). No real model is loaded."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from vericache_connector.cli import main
from vericache_connector.model.causal_lm import CausalLM

from tiny_model import TINY_HF_CONFIG, tiny_config

HF_CONFIG = TINY_HF_CONFIG


def checkpoint(path, config=HF_CONFIG, weights="tiny"):
    """A model folder: config.json (a dict, or raw text) and model.safetensors (tiny / junk bytes)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights == "tiny":
        state = {f"model.{k}": v.contiguous() for k, v in CausalLM(tiny_config()).state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
    elif weights == "narrow":  # another hidden size than config.json says
        state = {f"model.{k}": v for k, v in CausalLM(tiny_config(hidden_size=64, head_dim=16)).state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
    else:
        (path / "model.safetensors").write_bytes(weights)
    return str(path)


def one_error_line(capsys, argv, needle: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vericache: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and needle in err, err
    return err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_temperature(capsys, value):
    one_error_line(capsys, ["demo", "--single", f"--temperature={value}"], "temperature must be a finite number")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["demo", "--draft-k", "ten"], "invalid int value: 'ten'"),
        (["demo", "--max-new-tokens"], "expected one argument"),
        (["demo", "--no-such-flag"], "--no-such-flag"),
        (["serve-everything"], "'serve-everything'"),
        ([], "required"),
    ],
)
def test_argument_errors_are_one_line_too(capsys, argv, needle):
    one_error_line(capsys, argv, needle)


@pytest.mark.parametrize(
    "config,weights,needle",
    [
        ({"model_type": "llama"}, b"junk", "config.json lacks 'vocab_size'"),
        ({**HF_CONFIG, "num_attention_heads": 0}, "tiny", "config.json does not describe a model"),
        ({**HF_CONFIG, "head_dim": 32, "num_attention_heads": 0}, "tiny", "num_heads must be a positive integer"),
        ({**HF_CONFIG, "num_hidden_layers": "2"}, "tiny", "num_layers must be a positive integer"),
        ({**HF_CONFIG, "num_key_value_heads": 3}, "tiny", "not a multiple of"),
        ('{"model_type": "llama", ', "tiny", "is not valid JSON"),
        ("[1, 2]", "tiny", "is not a JSON object"),
        (HF_CONFIG, b"\x00" * 64, "is not a readable safetensors file"),
        (HF_CONFIG, b"", "is not a readable safetensors file"),
        (HF_CONFIG, "narrow", "config.json implies a float tensor of shape"),
        (HF_CONFIG, "tiny", "the tokenizer does not load"),  # weights fine, no tokenizer files
    ],
)
def test_model_folders_that_do_not_load(capsys, tmp_path, config, weights, needle):
    model = checkpoint(tmp_path / "ckpt", config, weights)
    one_error_line(capsys, ["demo", "--single", "--model", model, "--prompt", "graphlib_py"], needle)
