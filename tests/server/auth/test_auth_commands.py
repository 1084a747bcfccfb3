"""The authentication options of the sbp commands: servers started with
--auth-token-secret, tokens from `sbp token create`, and client commands that present them
with --token, --token-file or $SBP_TOKEN."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sbp_spark.server.auth.authenticator import AuthSettings
from sbp_spark.server.cluster import ProcessCluster

from .keys import Keys


def _sbp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sbp_spark.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_client_commands_present_tokens(tmp_path):
    keys = Keys(tmp_path / "keys")
    made = _sbp("token", "create", "--secret-key", str(keys.secret_file), "--subject", "ops",
                "--expires", "1h")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    token_file = tmp_path / "ops.token"
    token_file.write_text(token + "\n")
    auth = AuthSettings(token_secret_file=str(keys.secret_file), superusers=frozenset({"ops"}))
    with ProcessCluster(tmp_path / "cluster", range_servers=1, auth=auth) as cluster:
        pd = ["--pd", cluster.pd_address]
        done = _sbp("streams", "create", *pd, "--token-file", str(token_file))
        assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stderr
        done = _sbp("streams", "list", *pd, "--token", token)
        assert done.returncode == 0, done.stderr
        env = {**os.environ, "SBP_TOKEN": token}
        done = _sbp("streams", "list", *pd, env=env)
        assert done.returncode == 0, done.stderr
        env.pop("SBP_TOKEN")
        done = _sbp("streams", "list", *pd, env=env)
        assert done.returncode != 0
        assert "UNAUTHENTICATED" in done.stderr and len(done.stderr.strip().splitlines()) == 1
        done = _sbp("streams", "list", *pd, "--token", "garbage")
        assert done.returncode != 0 and "malformed" in done.stderr
        assert "garbage" not in done.stderr
        # Permissions: granted and revoked by a superuser, listed, refused to others.
        bob = keys.token("bob")
        done = _sbp("streams", "create", *pd, "--token", bob)
        assert done.returncode != 0 and "PERMISSION_DENIED" not in done.stdout
        assert "may not CREATE_STREAMS" in done.stderr
        for args in (["--operations", "create"], ["--operations", "read,write",
                                                    "--streams", "1,orders"]):
            done = _sbp("acl", "grant", *pd, "--token", token, "--principal", "bob", *args)
            assert done.returncode == 0, done.stderr
        done = _sbp("streams", "create", *pd, "--token", bob)
        assert done.returncode == 0, done.stderr
        done = _sbp("acl", "list", *pd, "--token", token, "--json")
        assert done.returncode == 0, done.stderr
        listed = {(e["principal"], e["operation"], e["stream"])
                  for e in map(json.loads, done.stdout.splitlines())}
        assert listed == {("bob", "create", None), ("bob", "read", "1"),
                          ("bob", "write", "1"), ("bob", "read", "orders"),
                          ("bob", "write", "orders")}
        done = _sbp("acl", "revoke", *pd, "--token", token, "--principal", "bob",
                    "--operations", "create")
        assert done.returncode == 0, done.stderr
        done = _sbp("acl", "grant", *pd, "--token", bob, "--principal", "bob",
                    "--operations", "admin", "--streams", "*")
        assert done.returncode != 0 and "only superusers may" in done.stderr
        done = _sbp("acl", "grant", *pd, "--token", token, "--principal", "bob",
                    "--operations", "read")
        assert done.returncode != 0 and "need --streams" in done.stderr


def test_token_create_and_server_options_say_what_is_wrong(tmp_path):
    keys = Keys(tmp_path / "keys")
    short = tmp_path / "short"
    short.write_text("too short")
    done = _sbp("token", "create", "--secret-key", str(short), "--subject", "a")
    assert done.returncode != 0 and "at least 32" in done.stderr
    done = _sbp("token", "create", "--secret-key", str(keys.secret_file), "--subject", "a",
                "--expires", "soon")
    assert done.returncode != 0 and "not a duration" in done.stderr
    done = _sbp("pd", "--data-dir", str(tmp_path / "pd"), "--superusers", "root")
    assert done.returncode != 0 and "--superusers needs authentication" in done.stderr
    done = _sbp("range-server", "--pd", "127.0.0.1:1", "--data-dir", str(tmp_path / "rs"),
                "--auth-token-public-key", str(keys.public_file))
    assert done.returncode != 0 and "--server-token" in done.stderr
