# SPDX-License-Identifier: MIT
"""An HTTPS server on the build host (the demo weights mirror, and the tests' servers) whose loop
can never be held by one client.

A listening socket wrapped in TLS shakes hands inside accept(): one client that connects and
stalls, or whose connection is reset between the loop's select and its accept, would hold
serve_forever, and shutdown() with it, for ever. Here accept() gives up after a second and the
handshake happens in the connection's own thread."""

from __future__ import annotations

import http.server
import socket
import ssl
import sys
from typing import Any

ACCEPT_WAIT_S = 1.0


class HTTPSServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, tls: ssl.SSLContext | None) -> None:
        self.tls = tls  # None: plain HTTP, for the tests that need it
        if ":" in address[0]:  # an IPv6 address ("::1", "2001:db8::5"): the class's AF_INET cannot bind it
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.settimeout(ACCEPT_WAIT_S)  # the accepted sockets block again (socket.accept)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a refused handshake or a client that went away is not the server's error
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)
