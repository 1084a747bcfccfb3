"""Who may do what (docs/wire.md, "Who may do what"): principals and their credentials, as
parts the PD and the range server build in.

``tokens.py`` makes and checks signed tokens (JWT, HS256 or RS256), ``principals.py`` is who a
connection speaks for, and ``authenticator.py`` turns a credential (a token, a TLS client
certificate) into a principal; the network core (``server/net.py``) asks it.
"""
