"""The range server: stores the ranges the PD gives it and serves APPEND and FETCH for them.

``server.py`` holds ``RangeServer``, the owner of the parts below; each part gets what it uses
through a small interface and imports neither the owner nor another part's internals:

* ``append.py``: the APPEND path; ``replication.py``: the calls to a range's secondaries;
  ``cap_notices.py``: read cap notices, sent and answered;
* ``fetch.py``: FETCH; ``admin.py``: the range administration requests; ``requests.py``: the
  request table that hands each request to its part;
* ``registration.py``: the link to the PD; ``retention.py``: deleting expired data;
* ``roles.py``: this server's role in each range; ``identity.py``: its id, kept on disk;
  ``metrics.py``: the counters reported to the PD; ``config.py``: ``RangeServerConfig``.

The ranges themselves live in ``sbp_spark.server.storage``.
"""

from __future__ import annotations

from .config import RangeServerConfig
from .server import RangeServer

__all__ = ["RangeServer", "RangeServerConfig"]
