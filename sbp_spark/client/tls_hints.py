"""What to change when TLS fails, added to a connection's error: OpenSSL says what went wrong
in its own words, not which setting or file is at fault."""

from __future__ import annotations

from sbp_spark.transport.tls import certificate_not_after

from .config import ClientConfig

_SETTINGS = {
    "ca": "tls_ca_file in ClientConfig, the Spark option tls.caFile or $SBP_TLS_CA for the sbp "
          "commands",
    "cert": "tls_cert_file and tls_key_file in ClientConfig, the Spark options tls.certFile "
            "and tls.keyFile, or $SBP_TLS_CERT and $SBP_TLS_KEY for the sbp commands",
}

# Alerts a TLS server sends when it refuses this client's certificate, in the words of
# OpenSSL's reason codes; with TLS 1.3 they arrive after the handshake, on the first read or
# as the reason a send failed. Each with what the user can change.
_REFUSED_CERTIFICATE = (
    ("alert certificate required",
     "the server requires a client certificate and this client presented none: set "
     + _SETTINGS["cert"]),
    ("alert unknown ca",
     "the server does not trust the CA that signed this client's certificate: use a "
     "certificate signed by a CA the server's client CA file lists"),
    ("alert certificate expired", "the server found this client's certificate expired"),
    ("alert bad certificate", "the server refused this client's certificate"),
    ("alert certificate unknown", "the server refused this client's certificate"),
)

# OpenSSL's X509_V_ERR_* codes for a chain that ends at no CA this client trusts.
_UNTRUSTED = frozenset({2, 18, 19, 20, 21})
_EXPIRED = 10


def refused_certificate_hint(exc: BaseException | None, config: ClientConfig) -> str:
    """What to change, for an error carrying a TLS alert that refused our certificate."""
    if exc is None:
        return ""
    text = str(exc).lower().replace("_", " ")
    for alert, hint in _REFUSED_CERTIFICATE:
        if alert in text:
            if alert == "alert certificate expired" and config.tls_cert_file:
                hint = _expired_hint(config.tls_cert_file)
            return f" ({hint})"
    return ""


def _expired_hint(cert_file: str) -> str:
    end = certificate_not_after(cert_file)
    when = f" (not valid after {end:%Y-%m-%d %H:%M:%S} UTC)" if end is not None else ""
    return (f"the server found this client's certificate {cert_file!r} expired{when}: renew "
            f"it, replacing the file")


def unverified_server_hint(exc: BaseException, config: ClientConfig) -> str:
    """What to change, for a handshake that failed because this client could not verify the
    server's certificate (``exc``'s cause carries OpenSSL's verify code)."""
    code = getattr(exc.__cause__, "verify_code", None)
    if code in _UNTRUSTED:
        if config.tls_ca_file:
            return (f" (the server's certificate is not signed by a CA in tls_ca_file "
                    f"{config.tls_ca_file!r}: give the CA that signed it in "
                    f"{_SETTINGS['ca']})")
        return (" (the server's certificate is not signed by a CA of the system's trust store: "
                f"give the CA that signed it in {_SETTINGS['ca']})")
    if code == _EXPIRED:
        return " (the server's certificate has expired: the server needs a renewed one)"
    return ""
