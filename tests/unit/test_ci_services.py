""".ci/with-services.sh (what `make test` runs pytest under): it starts the servers the store tests need and stops
them after, leaves a server given by URL alone, names why one could not start (the skipped tests print it),
and returns the command's exit status; tests/conftest.py ends a run with one line of what skipped and why."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from stores import ROOT, need

WRAPPER = Path(ROOT) / ".ci" / "with-services.sh"
SHOW_ENV = (
    "import os, sys; "
    "print(repr({k: os.environ.get(k) for k in "
    "('VERICACHE_REDIS_URL', 'VERICACHE_REDIS_DOWN', 'VERICACHE_S3_ENDPOINT', 'VERICACHE_S3_DOWN')})); "
    "sys.exit(int(sys.argv[1]))"
)


def fake_venv(tmp_path: Path) -> Path:
    """A venv folder with this Python and nothing else (no moto_server)."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    return tmp_path / "venv"


def bare_path(tmp_path: Path) -> str:
    """A PATH with the tools the scripts use, and no redis-server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "mktemp", "cat", "sleep", "tail", "id", "rm", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def wrapper(venv: Path, env: dict, *command: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERICACHE_", "CI"))}
    base["VERICACHE_SERVICES_DIR"] = str(venv.parent / "services")  # logs here, not in /tmp
    return subprocess.run(
        ["bash", str(WRAPPER), str(venv), *command], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_a_server_that_cannot_start_is_named_and_the_exit_status_is_the_commands(tmp_path):
    venv = fake_venv(tmp_path)
    env = {"PATH": bare_path(tmp_path), "VERICACHE_SKIP_INSTALL": "1"}
    out = wrapper(venv, env, sys.executable, "-c", SHOW_ENV, "3")
    assert out.returncode == 3, out.stderr
    seen = eval(out.stdout)
    assert seen["VERICACHE_REDIS_URL"] is None and seen["VERICACHE_S3_ENDPOINT"] is None
    assert seen["VERICACHE_REDIS_DOWN"] == "redis-server could not start: redis-server is not installed"
    assert (
        seen["VERICACHE_S3_DOWN"].startswith("moto_server (S3) could not start: ")
        and "moto" in seen["VERICACHE_S3_DOWN"]
    )
    assert "their tests will skip" in out.stderr


def test_starts_redis_for_the_command_and_stops_it_after(tmp_path):
    need(shutil.which("redis-server") is not None, "redis-server is not installed")
    venv = fake_venv(tmp_path)
    given = "http://127.0.0.1:9/not-started"  # a URL already set is left alone (no moto_server is needed)
    code = (
        "import os, socket, sys; from urllib.parse import urlsplit; "
        "u = urlsplit(os.environ['VERICACHE_REDIS_URL']); s = socket.create_connection((u.hostname, u.port), 5); "
        "s.sendall(b'PING\\r\\n'); assert s.recv(16).startswith(b'+PONG'); "
        "assert os.environ['VERICACHE_S3_ENDPOINT'] == sys.argv[1] and 'VERICACHE_REDIS_DOWN' not in os.environ; "
        "print(u.port)"
    )
    out = wrapper(venv, {"VERICACHE_S3_ENDPOINT": given}, sys.executable, "-c", code, given)
    assert out.returncode == 0, out.stderr
    port = int(out.stdout)
    with socket.socket() as s:  # stopped: nothing answers on its port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_run_ends_with_what_skipped_and_why(tmp_path):
    """The store fixtures skip with the reason the wrapper exported; the last line before pytest's counts
    groups the skips by reason."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERICACHE_", "CI", "PYTEST_"))}
    env = {**base, "VERICACHE_REDIS_DOWN": "redis-server could not start: XYZ", "VERICACHE_S3_DOWN": "no S3: ABC"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-k", "round_trip and (redis or s3)"]
        + ["tests/integration/stores/test_storage_backends.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and "2 skipped" in lines[-1], out.stdout[-2000:]
    assert lines[-2] == "skipped 2 tests: 1 x redis-server could not start: XYZ; 1 x no S3: ABC", lines[-4:]
    assert "short test summary info" in out.stdout.split(lines[-2])[0]
