"""Tokens and authentication settings on their own (no servers)."""

from __future__ import annotations

import argparse

import pytest

from sbp_spark.protocol.errors import UnauthenticatedError
from sbp_spark.server.auth.authenticator import Authenticator, AuthSettings
from sbp_spark.server.auth.tokens import TokenVerifier, create_token, parse_duration


def test_a_token_carries_its_subject_role_and_end(keys):
    claims = TokenVerifier(secret=keys.secret).verify(keys.token("rs", 60, role="server"))
    assert (claims.subject, claims.role) == ("rs", "server") and claims.expires is not None
    forever = TokenVerifier(secret=keys.secret).verify(keys.token("ops", None))
    assert forever.role == "" and forever.expires is None
    rs = TokenVerifier(public_key=keys.public_file.read_bytes()).verify(keys.rs_token("x"))
    assert rs.subject == "x"


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("15m", 900), ("1h", 3600),
                                          ("7d", 604800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "0h", "-1h", "1w", "soon"])
def test_bad_durations_say_what_is_expected(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_keys_that_cannot_work_are_refused_when_the_server_starts(keys):
    with pytest.raises(ValueError, match="at least 32"):
        TokenVerifier(secret=b"short")
    with pytest.raises(ValueError, match="public half"):
        TokenVerifier(public_key=keys.private_pem)
    with pytest.raises(ValueError, match="not a PEM RSA public key"):
        TokenVerifier(public_key=b"not a key")
    with pytest.raises(ValueError, match="exactly one"):
        create_token("a")
    with pytest.raises(ValueError, match="role 'admin' is not known"):
        create_token("a", secret=keys.secret, role="admin")
    with pytest.raises(ValueError, match="not both"):
        AuthSettings(token_secret_file="a", token_public_key_file="b")


def test_an_unknown_role_claim_is_refused(keys):
    import jwt

    token = jwt.encode({"sub": "x", "role": "root"}, keys.secret, algorithm="HS256")
    with pytest.raises(UnauthenticatedError, match="role 'root'"):
        TokenVerifier(secret=keys.secret).verify(token)


def test_roles_of_principals():
    authenticator = Authenticator(None, {"root"}, certificates=True)
    assert authenticator.principal("root").superuser and authenticator.principal("root").server
    assert authenticator.principal("rs", "server").server
    assert not authenticator.principal("rs", "server").superuser
    plain = authenticator.principal("alice")
    assert not plain.server and not plain.superuser
    cert = {"subject": ((("commonName", "client"),),), "subjectAltName": (("DNS", "x"),)}
    assert authenticator.of_certificate(cert).name == "client"
    assert authenticator.of_certificate({"subjectAltName": (("DNS", "host-a"),)}).name == \
        "host-a"
    with pytest.raises(UnauthenticatedError, match="does not accept tokens"):
        authenticator.authenticate("token", b"x.y.z")


@pytest.mark.parametrize("given,tokens,certificates", [
    ({}, False, False),
    ({"tls_ca": "ca.pem"}, False, False),  # TLS alone keeps the cluster open, as before
    ({"auth_token_secret": "SECRET"}, True, False),
    ({"auth_token_secret": "SECRET", "tls_ca": "ca.pem"}, True, True),
    ({"tls_ca": "ca.pem", "superusers": frozenset({"node"})}, False, True),
])
def test_which_server_options_turn_what_on(keys, given, tokens, certificates):
    from sbp_spark.commands.servers import _auth_of

    args = {"auth_token_secret": None, "auth_token_public_key": None, "tls_ca": None,
            "superusers": frozenset(), "server_token": None, **given}
    if args["auth_token_secret"] == "SECRET":
        args["auth_token_secret"] = str(keys.secret_file)
    auth = _auth_of(argparse.Namespace(**args))
    assert (auth.tokens, auth.certificates) == (tokens, certificates)
