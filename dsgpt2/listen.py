"""Whether this process could listen where a server is asked to: said in one line before the server
starts (``dsgpt2 serve``, ``dsgpt2 db serve``)."""

from __future__ import annotations

import errno
import socket

from dsgpt2.errors import ConfigError


def check_bind(host: str, port: int) -> None:
    """Fail with one line where a server could not listen (a busy port, an address not of this host).

    Raises:
        ConfigError: the address cannot be bound, naming it and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT is free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--port {port} on {host} is in use by another program; choose another --port"
                ) from None
            raise ConfigError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror}); use an address of "
                "this machine (127.0.0.1 by default) and a port above 1023"
            ) from None


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` of 127.0.0.1: bound as it binds (SO_REUSEADDR), so that the
    connections of a server just killed, in TIME_WAIT, do not keep its successor off its port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
