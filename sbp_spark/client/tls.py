"""The TLS settings under the name the client layer gave them first. TLS is shared by the
client and the servers, so it lives below both, in ``sbp_spark.transport.tls``; import it from
there."""

from ..transport.tls import TlsConfig, TlsError

__all__ = ["TlsConfig", "TlsError"]
