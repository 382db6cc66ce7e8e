"""``WindowNet``: a communicator's window server and its links to peers on other hosts.

Created by the communicator at the first registration that has a peer on another host
(every member registers at the same point, so all create theirs together), shared by all
of the comm's windows, closed by ``finalize`` (links say ``BYE`` first, so peers do not
mistake a finalize for a death).  Links are dialled on the op thread during a
registration, once per peer; the server accepts them on its own thread.
"""

from __future__ import annotations

import socket

from torchcomms.errors import CommError
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.window.tcp import PeerLink, WindowServer


class WindowNet:
    """The server and the links of one communicator (module docstring)."""

    def __init__(self, rank: int, bind: str, name: str) -> None:
        self.rank = rank
        self.server = WindowServer(rank, bind, name)
        self._advertised = socket.gethostname() if bind in ("0.0.0.0", "::") else bind
        self._links: dict[int, PeerLink] = {}

    def address(self) -> dict[str, object]:
        """This rank's part of a registration record: where its server listens."""
        return {"host": self._advertised, "port": self.server.port, "token": self.server.token}

    def link(self, peer: int, record: dict[str, object], deadline: Deadline) -> PeerLink:
        """The link to ``peer`` (dialled on first use, with ``record``'s address)."""
        link = self._links.get(peer)
        if link is None:
            try:
                link = PeerLink(
                    self.rank,
                    peer,
                    str(record["host"]),
                    int(str(record["port"])),
                    str(record["token"]),
                    deadline.left_s(),
                )
            except (OSError, KeyError, ValueError) as exc:
                raise CommError(
                    f"window: cannot connect to peer rank {peer}'s window server: {exc}"
                ) from exc
            self._links[peer] = link
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self.server.close()
