"""Raw mTLS connections to a port, below gRPC: what certificate a server presents, and whether it keeps a connection.

For bounds that act before any call (a connection limit, a drained listener,
a renewed certificate), which a gRPC channel hides behind its reconnects.
"""

from __future__ import annotations

import socket
import ssl

from cryptography import x509

from servicekit.identity import IdentityFiles

#: A client's HTTP/2 connection preface and an empty SETTINGS frame (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _context(files: IdentityFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    return context


def connect(port: int, files: IdentityFiles, timeout: float = 5.0) -> ssl.SSLSocket | None:
    """A connection with its handshake done, presenting ``files``; None if the server closed it first."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        return _context(files).wrap_socket(raw, server_hostname="localhost")
    except socket.timeout:
        raw.close()
        raise
    except (ConnectionError, ssl.SSLError):
        raw.close()
        return None


def is_open(sock: ssl.SSLSocket | None, timeout: float = 5.0) -> bool:
    """Whether the server keeps ``sock``: given a client's preface, a kept HTTP/2 connection answers with its
    SETTINGS, a closed one with EOF or a reset. A server that does neither within ``timeout`` fails the test."""
    if sock is None:
        return False
    try:
        sock.settimeout(timeout)
        sock.sendall(H2_PREFACE)
        return sock.recv(1) != b""
    except socket.timeout:
        raise AssertionError(f"the server neither spoke nor closed within {timeout:g} s") from None
    except (ConnectionError, ssl.SSLError):
        return False


def served_serial(port: int, files: IdentityFiles) -> str | None:
    """The serial (hex) of the certificate the server presents on a new connection now; None while it does not
    accept one."""
    try:
        sock = connect(port, files)
    except OSError:
        return None
    if sock is None:
        return None
    with sock:
        return format(x509.load_der_x509_certificate(sock.getpeercert(binary_form=True)).serial_number, "x")
