"""A web process behind the front (platform/front.py, `make run` with WEB_WORKERS above 1): a
thread takes the connections the front hands over (the socket and the bytes of its head the
front read to route it) and the reactor adopts each as if daphne had accepted it.

The thread connects to FRONT_SOCKET, says its number (WEB_WORKER), then receives one message a
connection. The front gone (restarted), it connects again; meanwhile the process still serves
its own loopback port (the fleet's url for it: probes, /metrics) and the connections it has.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)

HEAD_BYTES = 16 * 1024 + 1024  # platform/front.py's REQUEST_HEAD_BYTES, with room
RECONNECT_S = 0.5


class _Adopting:
    """The daphne factory, remembering the protocol it builds for the adopted connection."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.built = None

    def buildProtocol(self, addr):  # Twisted's name
        self.built = self.factory.buildProtocol(addr)
        return self.built


def adopt(fd: int, head: bytes, front: _Link) -> None:
    """On the reactor: serve connection `fd` (closed here), whose first bytes `head` the front
    read. The front is told first: until then it keeps the connection, to hand it to another
    web process should this one die before it took it."""
    from daphne.server import Server
    from twisted.internet import reactor

    front.took()
    try:
        probe = socket.socket(fileno=fd)  # its family, from the kernel
        family = probe.family
        probe.detach()
        adopting = _Adopting(Server.serving.http_factory)
        reactor.adoptStreamConnection(fd, family, adopting)  # Twisted takes a copy of the descriptor
    except Exception:  # a connection that closed meanwhile, or reset: it alone is lost
        log.exception("could not take a connection from the front")
        return
    finally:
        os.close(fd)
    protocol = adopting.built
    if head and protocol is not None:  # Twisted's HTTP protocol (a wrapper: its channel has the transport)
        protocol.dataReceived(head)  # before anything the socket holds: the reactor reads it later


class _Link:
    """This process's socket to the front, and the connections it took that the front has not
    been told of yet (reactor only)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.owed = 0
        self.retry = None

    def took(self, count: int = 1) -> None:
        """Tell the front (a byte a connection), never blocking the reactor: what the socket
        does not take now goes with the next, or 10 ms later."""
        from twisted.internet import reactor

        self.owed += count
        try:
            self.sock.send(b"t" * self.owed, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if self.retry is None or not self.retry.active():
                self.retry = reactor.callLater(0.01, self.took, 0)
            return
        except OSError:  # the front is gone, or restarting: it dropped its descriptors already
            pass
        self.owed = 0


def _take(path: str, number: int) -> None:
    from twisted.internet import reactor

    said = False
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            sock.sendall(str(number).encode())
            link = _Link(sock)
            if said:
                log.info("connected to the front again")
            said = True
            while True:
                head, fds, _, _ = socket.recv_fds(sock, HEAD_BYTES, 1)
                if not head and not fds:
                    break  # the front is gone
                for fd in fds:
                    reactor.callFromThread(adopt, fd, head, link)
        except OSError as exc:
            if said:
                log.warning("the front is away (%s); connecting again", exc)
                said = False
        finally:
            sock.close()
        time.sleep(RECONNECT_S)


def start(path: str, number: int) -> None:
    """Begin taking connections from the front (once; a serving call, config.asgi)."""
    if any(t.name == "front-connections" for t in threading.enumerate()):
        return
    threading.Thread(target=_take, args=(path, number), name="front-connections", daemon=True).start()
