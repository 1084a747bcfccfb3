"""What both ends of an SBP connection share below the client and the servers: TLS over a
blocking socket (``tls``) and the socket calls every sender makes (``sockets``). No frames
and no requests here: those are the protocol's and the client's."""
