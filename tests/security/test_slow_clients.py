"""Issue item 5: slow clients are timed out (raw sockets that dribble a request).

The secure server runs with ``server.header_timeout_s = 2`` and ``server.body_timeout_s = 2``.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx

from tests.security.conftest import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

SLACK_S = 3.0
DRIBBLE_EVERY_S = 0.25


def _connect(server) -> socket.socket:
    url = urlsplit(server.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.settimeout(0.05)
    return sock


def _dribble_until_closed(sock: socket.socket, data: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send ``data`` one byte at a time; return (seconds until the server closed, what it sent)."""
    t0 = time.monotonic()
    received = b""
    i = 0
    while time.monotonic() - t0 < limit_s:
        if i < len(data):
            try:
                sock.send(data[i:i + 1])
            except OSError:  # reset: closed
                return time.monotonic() - t0, received
            i += 1
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return time.monotonic() - t0, received
            received += chunk
        except socket.timeout:
            pass
        except OSError:
            return time.monotonic() - t0, received
        time.sleep(DRIBBLE_EVERY_S)
    raise AssertionError(f"the server kept a dribbling connection open for {limit_s:.0f} s")


def test_dribbled_request_head_is_closed(secure_server):
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 400
    with _connect(secure_server) as sock:
        elapsed, received = _dribble_until_closed(sock, head, HEADER_TIMEOUT_S + SLACK_S + 5)
    assert elapsed < HEADER_TIMEOUT_S + SLACK_S
    assert received == b""  # closed without an answer: the head never completed


def test_idle_connection_without_request_is_closed(secure_server):
    with _connect(secure_server) as sock:
        elapsed, _ = _dribble_until_closed(sock, b"", HEADER_TIMEOUT_S + SLACK_S + 5)
    assert elapsed < HEADER_TIMEOUT_S + SLACK_S


def test_dribbled_body_gets_408_and_close(secure_server):
    body = json.dumps({"model": secure_server.model_id, "prompt": "x" * 200, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with _connect(secure_server) as sock:
        sock.sendall(head)
        elapsed, received = _dribble_until_closed(sock, body, BODY_TIMEOUT_S + SLACK_S + 5)
    assert elapsed < BODY_TIMEOUT_S + SLACK_S
    status_line, _, rest = received.partition(b"\r\n")
    assert b" 408 " in status_line, received
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_dribbled_upload_body_gets_408(secure_server):
    head = (b"POST /v1/adapters/slow/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/gzip\r\n"
            b"Content-Length: 100000\r\n\r\n")
    with _connect(secure_server) as sock:
        sock.sendall(head)
        elapsed, received = _dribble_until_closed(sock, b"\x1f" * 1000, BODY_TIMEOUT_S + SLACK_S + 5)
    assert elapsed < BODY_TIMEOUT_S + SLACK_S
    assert b" 408 " in received.partition(b"\r\n")[0], received


def test_many_slowloris_connections_are_all_dropped(secure_server):
    """400 connections that never finish their head (the issue's slowloris): all closed in time, server still answers."""
    socks = [_connect(secure_server) for _ in range(400)]
    for s in socks:
        s.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a")
    t0 = time.monotonic()
    assert httpx.get(f"{secure_server.base_url}/health", timeout=10).status_code == 200
    open_socks = set(socks)
    while open_socks and time.monotonic() - t0 < HEADER_TIMEOUT_S + SLACK_S + 5:
        readable, _, _ = select.select(list(open_socks), [], [], 0.2)
        for s in readable:
            try:
                if s.recv(1024) == b"":
                    open_socks.discard(s)
            except socket.timeout:
                pass
            except OSError:
                open_socks.discard(s)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    assert not open_socks, f"{len(open_socks)} slow connections still open after {elapsed:.1f} s"
    assert elapsed < HEADER_TIMEOUT_S + SLACK_S + 1


def test_keep_alive_connection_waiting_for_next_head_is_closed(secure_server):
    with _connect(secure_server) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b" 200 " in sock.recv(65536).partition(b"\r\n")[0]
        sock.settimeout(0.05)
        elapsed, _ = _dribble_until_closed(sock, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 200,
                                           HEADER_TIMEOUT_S + SLACK_S + 5)
    assert elapsed < HEADER_TIMEOUT_S + SLACK_S


def test_oversized_head_is_431(secure_server):
    with _connect(secure_server) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        received = b""
        try:
            for _ in range(100):
                sock.sendall(b"X-Big: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed under us: also a refusal
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass
    # 431 then close; a reset (unread data on the server side) may swallow the 431, never a 200
    assert received == b"" or received.startswith(b"HTTP/1.1 431 "), received[:200]


def _one_segment(srv, head_bytes: int) -> bytes:
    """A request whose head (``head_bytes`` in all) and small JSON body go out in one write."""
    body = b'{"model": "x", "prompt": "a", "max_tokens": 1}'
    start = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n" % len(body))
    pad = head_bytes - len(start) - len(b"X-Pad: \r\n\r\n")
    with _connect(srv) as sock:
        sock.settimeout(20)
        sock.sendall(start + b"X-Pad: " + b"p" * pad + b"\r\n\r\n" + body)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass
    return received


def test_head_limit_is_exactly_64_kib_even_in_one_segment(secure_server):
    """A head over 64 KiB arriving whole with its body was parsed and served (70-131 KB got 200)."""
    for size in (64 * 1024 + 1, 70_000, 131_000):
        received = _one_segment(secure_server, size)
        assert received == b"" or received.startswith(b"HTTP/1.1 431 "), (size, received[:100])
    assert not _one_segment(secure_server, 64 * 1024).startswith(b"HTTP/1.1 431 ")


def test_large_body_in_first_segment_is_not_mistaken_for_a_head(client, secure_server):
    """A big JSON body arriving with its head is a body, not an oversized head (400: prompt too long)."""
    body = {"model": secure_server.model_id, "prompt": "a" * 300_000, "max_tokens": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
