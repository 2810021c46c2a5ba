"""Credentials in k8s/ come only from Secrets (env from secretKeyRef, or files in a Secret volume), and the
Redis password is a mounted file, never argv or the environment: the Redis container's own start script and
probe, run with a local redis-server.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from storage_backends import open_backend

from k8s_objects import SECRETS, all_objects, docs, find, helm_values, kv_transfer_config, secret_volume_of
from paths import K8S

CREDENTIAL = re.compile(r"URL|PASSWORD|SECRET|TOKEN|KEY", re.I)


def test_credentials_come_only_from_secrets():
    objects = all_objects()
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            assert not [k for k in obj["data"] if CREDENTIAL.search(k)], obj["metadata"]["name"]
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for var in c.get("env", []):
                if CREDENTIAL.search(var["name"]) and var["name"].endswith("_FILE"):  # a path, into a Secret volume
                    assert secret_volume_of(obj, c, var["value"]), var
                elif CREDENTIAL.search(var["name"]):
                    assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
            argv = c.get("command", []) + c.get("args", [])
            if "--kv-transfer-config" in argv:
                extra = json.loads(kv_transfer_config(argv)).get("kv_connector_extra_config", {})
                assert "store" not in extra, "the store URL may carry credentials: it belongs in the Secret"
    secret_names = {
        r["secretKeyRef"]["name"]
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        for r in [e.get("valueFrom", {})]
        if "secretKeyRef" in r
    } | {
        v["secret"]["secretName"]
        for o in objects
        if o["kind"] == "Deployment"
        for v in o["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    assert secret_names == {"vericache-store", "vericache-verifier", "vericache-router"}
    assert secret_names == {docs(p)[0]["metadata"]["name"] for p in SECRETS.values()}


# -- The Redis password: a mounted file, never argv or the environment --------------------------------


def redis_deployments() -> list[dict]:
    return [
        find(docs(K8S / "manifests" / "redis" / "redis.yaml"), "Deployment", "vericache-redis"),
        find(helm_values()["extraObjects"], "Deployment", "vericache-redis"),
    ]


def redis_container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_redis_password_comes_from_a_mounted_file_not_argv_or_env():
    for deployment in redis_deployments():
        pod = deployment["spec"]["template"]["spec"]
        c = redis_container(deployment)
        argv = c.get("command", []) + c.get("args", [])
        assert "--requirepass" not in argv and not any("$(REDIS_PASSWORD)" in a for a in argv), argv
        assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], c.get("env")
        probe = " ".join(c["readinessProbe"]["exec"]["command"])
        assert " -a " not in probe and "REDISCLI_AUTH=" in probe, probe
        # the script's password file lies in the Secret volume, readable by the pod's group only
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        path = argv[argv.index("redis-start") + 1]
        secret = volumes[mounts[str(Path(path).parent)]]["secret"]
        assert secret["secretName"] == "vericache-store"
        assert {"key": "REDIS_PASSWORD", "path": Path(path).name} in secret["items"]
        assert secret["defaultMode"] & 0o007 == 0 and pod["securityContext"]["fsGroup"] == 999
        assert Path(path).parent.as_posix() in probe
        conf = argv[argv.index("redis-start") + 2]
        assert volumes[mounts[str(Path(conf).parent)]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("password", ["p@ss/w#rd?%41\"'\\ $x:[]", "0123456789abcdef0123456789abcdef"])
def test_redis_start_script_serves_with_the_files_password(tmp_path, password):
    """The container's own script and probe, run with the local redis-server: it authenticates with the
    file's password (percent-encoded in the store URL), refuses without it, and the password is in
    neither redis-server's command line nor its environment."""
    import os
    import shutil
    import time
    from urllib.parse import quote

    from net import free_port
    from stores import need, run

    need(shutil.which("redis-server") and shutil.which("redis-cli"), "redis-server/redis-cli are not installed")
    c = redis_container(redis_deployments()[0])
    argv = c["command"]
    assert argv[:2] == ["sh", "-c"]
    secret_dir = str(Path(argv[argv.index("redis-start") + 1]).parent)
    (tmp_path / "REDIS_PASSWORD").write_text(password + "\n")  # a trailing newline, as from a file
    conf, port = tmp_path / "redis.conf", free_port()
    cmd = ["sh", "-c", argv[2], "redis-start", str(tmp_path / "REDIS_PASSWORD"), str(conf)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        probe = [a.replace(secret_dir, str(tmp_path)) for a in c["readinessProbe"]["exec"]["command"]]
        probe[-1] = probe[-1].replace("redis-cli", f"redis-cli -p {port}")
        deadline = time.monotonic() + 15
        while subprocess.run(probe, capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not become ready"
            time.sleep(0.1)
        secret = password.encode()
        for part in ("cmdline", "environ"):
            assert secret not in Path(f"/proc/{proc.pid}/{part}").read_bytes(), part
        assert b"redis-server" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # exec'd: the script is gone
        assert os.stat(conf).st_mode & 0o077 == 0
        (tmp_path / "wrong").mkdir()
        (tmp_path / "wrong" / "REDIS_PASSWORD").write_text("not-the-password")
        wrong = [a.replace(str(tmp_path), str(tmp_path / "wrong")) for a in probe]
        assert subprocess.run(wrong, capture_output=True).returncode != 0
        nopass = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        assert "NOAUTH" in nopass.stdout + nopass.stderr

        async def round_trip():
            b = open_backend(f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0")
            await b.put("k", b"v")
            value = await b.get("k")
            await b.close()
            return value

        assert run(round_trip(), timeout=30) == b"v"
    finally:
        proc.kill()
        proc.wait(10)
    (tmp_path / "empty").write_text("\n")
    empty = subprocess.run(["sh", "-c", argv[2], "redis-start", str(tmp_path / "empty"), str(conf)], timeout=10)
    assert empty.returncode != 0  # no password, no Redis (requirepass "" would let anyone in)
