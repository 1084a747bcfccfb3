"""Who a range server is: its server id, kept in its data directory across restarts."""

from __future__ import annotations

import json
import logging
import os

from ..storage.segment import atomic_write

log = logging.getLogger(__name__)

# The file in a data directory that names the server the data belongs to.
SERVER_FILE = "server.json"


class ServerIdentity:
    """The id of the range server whose data is in ``data_dir``.

    ``wanted`` >= 0 fixes the id (tests, standalone use) and records it; -1 takes the id stored
    in ``data_dir``, or none yet (-1) until ``set`` records the one the PD allocates.
    """

    def __init__(self, data_dir: str, wanted: int = -1) -> None:
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, SERVER_FILE)
        stored = self._stored()
        self._server_id = stored
        if wanted >= 0:
            if stored >= 0 and stored != wanted:
                log.warning("data dir %s belonged to server %d; now server %d", data_dir,
                            stored, wanted)
            if stored != wanted:
                self.set(wanted)

    def _stored(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return int(json.loads(f.read())["server_id"])
        except FileNotFoundError:
            return -1
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{self.path} is unreadable: {exc}") from exc

    @property
    def server_id(self) -> int:
        """The id (-1 until one is known)."""
        return self._server_id

    def set(self, server_id: int) -> None:
        """Adopt ``server_id`` and keep it on disk for restarts."""
        atomic_write(self.path, json.dumps({"server_id": server_id}).encode())
        self._server_id = server_id
