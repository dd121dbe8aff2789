"""GET /v1/files/{id}/content under a hostile tenant: a download is streamed from the database
a slice at a time and held to a bounded buffer while its client does not read, and a tenant
has at most FILES_MAX_CONCURRENT_DOWNLOADS in flight.

Read whole, each download of a file held it three times in the web process (the database's
row, a copy, Twisted's buffer for a client that reads nothing): four stalled downloads of a
19 MB file grew the process by 176 MB, and of a 100 MiB file (FILES_MAX_BYTES) by gigabytes.

Tenant: "uploads-acme" (a batch tier) on the shared live platform.
"""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from inference import catalog
from tests.live import LiveServer

pytestmark = pytest.mark.slow

TIMEOUT_S = 60  # a hang guard, never a timing assertion
LINES = 40_000
LIMIT = 4  # FILES_MAX_CONCURRENT_DOWNLOADS' default


def _file(count: int) -> bytes:
    pad = "x" * 700  # ~820 bytes a line: 40,000 lines are ~31 MiB
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": catalog.served_model_id(), "max_tokens": 4,
                                        "messages": [{"role": "user", "content": f"{pad} {i}"}]}}) + "\n"
                   for i in range(count)).encode()


def _server(live: LiveServer) -> psutil.Process:
    port = urlsplit(live.url).port
    for proc in psutil.process_iter():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")):
                return proc
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    raise AssertionError(f"no process listens on port {port}")


def _stalled_download(live: LiveServer, key: str, file_id: str) -> socket.socket:
    parts = urlsplit(live.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
    sock.connect((parts.hostname, parts.port))
    sock.sendall(f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                 f"Authorization: Bearer {key}\r\n\r\n".encode())
    return sock


def test_downloads_a_client_does_not_read_hold_no_copy_of_the_file_and_are_bounded_per_tenant(
        hostile_live: LiveServer):
    key = hostile_live.keys["uploads-acme"]
    content = _file(LINES)
    uploaded = requests.post(hostile_live.url + "/v1/files", headers={"Authorization": f"Bearer {key}"},
                             data={"purpose": "batch"}, files={"file": ("big.jsonl", content)}, timeout=TIMEOUT_S)
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    server = _server(hostile_live)

    def download() -> requests.Response:
        return requests.get(f"{hostile_live.url}/v1/files/{file_id}/content",
                            headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S)
    whole = download()  # also warms the pool that reads the slices
    assert whole.status_code == 200
    assert whole.headers["Content-Length"] == str(len(content))
    assert whole.content == content

    before = server.memory_info().rss
    stalled = [_stalled_download(hostile_live, key, file_id) for _ in range(LIMIT)]
    try:
        time.sleep(3)  # as long as the server would take to push what it will
        grown = server.memory_info().rss - before
        assert grown < len(content), f"{LIMIT} stalled downloads of a {len(content)}-byte file grew the server by {grown}"

        refused = download()
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_downloads"
        assert refused.headers["Retry-After"]
    finally:
        for sock in stalled:
            sock.close()

    deadline = time.monotonic() + TIMEOUT_S
    while (again := download()).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)  # until the server sees the stalled clients leave
    assert again.status_code == 200 and again.content == content


def test_a_file_deleted_during_its_download_cuts_the_download_off(hostile_live: LiveServer):
    """The download's next slice finds no file: the connection is aborted, so the client sees
    its body cut short of Content-Length. Daphne answered the view's exception with its 500
    page, which raised inside its application checker once the response had started: the
    client waited for the rest until its own timeout, and the checker never ran again."""
    key = hostile_live.keys["uploads-acme"]
    headers = {"Authorization": f"Bearer {key}"}
    content = _file(LINES)
    uploaded = requests.post(hostile_live.url + "/v1/files", headers=headers, data={"purpose": "batch"},
                             files={"file": ("gone.jsonl", content)}, timeout=TIMEOUT_S)
    file_id = uploaded.json()["id"]
    download = requests.get(f"{hostile_live.url}/v1/files/{file_id}/content", headers=headers, stream=True,
                            timeout=TIMEOUT_S)
    chunks = download.iter_content(64 * 1024)
    received = len(next(chunks))
    assert requests.delete(f"{hostile_live.url}/v1/files/{file_id}", headers=headers,
                           timeout=TIMEOUT_S).status_code == 200
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # not a timeout: the server cut it
        for chunk in chunks:
            received += len(chunk)
    assert received < len(content)
