"""Connections to the server `crucible serve` runs: idle ones (opened, nothing sent) and slow ones
(headers a line at a time, a body a few bytes at a time) are closed after serve.client_timeout, so
they cannot hold the serve.max_concurrency slots; a request over that limit gets a 503 naming it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.workspaces import registered_workspace

from tasks.registry.serving import free_port, stop_server, wait_until_serving

WAIT_S = 180  # loading torch, mlflow and the model on a busy 2-core machine
RECORD = {"dataframe_records": [{"text": "a great film", "task": "rotten"}]}


def post(url: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return registered_workspace(tmp_path_factory)


@pytest.fixture(scope="module")
def tight_server(ws, tmp_path_factory):
    """The server `crucible serve` runs, for the champion, with serve.max_concurrency 4 and
    serve.client_timeout 2 s (the rest of params' serve section as is)."""
    import yaml

    from flows.registry_cli import registered
    from tasks.registry.serving import download_version, serve_command

    limits = {**yaml.safe_load((ws / "params.yaml").read_text())["serve"], "max_concurrency": 4, "client_timeout": 2}
    name, _, mv = registered(ws, "champion")
    tmp = tmp_path_factory.mktemp("tight")
    model_dir = download_version(ws, name, mv.version, tmp / "model")
    port = free_port()
    cmd, env = serve_command(model_dir, "127.0.0.1", port, limits)
    with open(tmp / "serve.log", "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, proc, WAIT_S, tmp / "serve.log")
        yield base, port, limits
    finally:
        stop_server(proc)


def closed_within(sock, seconds: float) -> tuple[float, bytes]:
    """(seconds until the server closed `sock`, what it sent first); AssertionError if it is still
    open after `seconds`."""
    import socket

    start, got = time.monotonic(), b""
    sock.settimeout(0.5)
    while time.monotonic() - start < seconds:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - start, got
        if not chunk:
            return time.monotonic() - start, got
        got += chunk
    raise AssertionError(f"the server kept the connection open for {seconds:.0f} s; it sent {got[:200]!r}")


def test_idle_connections_time_out_and_a_503_names_the_param(tight_server):
    """serve.max_concurrency idle connections (opened, nothing sent) take every slot: a request gets
    503 naming serve.max_concurrency at once, and is answered once serve.client_timeout closed them."""
    import socket

    base, port, limits = tight_server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(limits["max_concurrency"])]
    opened = time.monotonic()
    try:
        time.sleep(0.3)  # the server has taken them
        status, body = post(f"{base}/invocations", RECORD)
        assert status == 503, (status, body)
        assert "serve.max_concurrency" in body["message"] and f"{limits['max_concurrency']}" in body["message"]
        while True:
            status, body = post(f"{base}/invocations", RECORD)
            if status == 200 or time.monotonic() - opened > limits["client_timeout"] + 8:
                break
            time.sleep(0.2)
        assert status == 200, f"still {status} {time.monotonic() - opened:.1f} s after the idle connections opened"
        for sock in idle:  # closed by the server, with nothing sent (they sent nothing either)
            assert closed_within(sock, 2)[1] == b""
    finally:
        for sock in idle:
            sock.close()


def test_slow_headers_and_slow_bodies_are_cut_off_with_408_naming_the_param(tight_server):
    """A client that sends its headers a line at a time, or a declared body a few bytes at a time,
    keeps no slot past serve.client_timeout: 408 naming it, then the connection is closed."""
    import socket

    base, port, limits = tight_server
    timeout = limits["client_timeout"]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        try:
            for i in range(4 * timeout):  # a header line every 0.5 s: never idle, never done
                sock.sendall(f"X-Slow-{i}: y\r\n".encode())
                time.sleep(0.5)
        except (BrokenPipeError, ConnectionResetError):
            pass
        took, sent = closed_within(sock, timeout + 8 - (time.monotonic() - start))
        assert b" 408 " in sent.split(b"\r\n")[0] and b"serve.client_timeout" in sent, sent
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        start = time.monotonic()
        try:
            for _ in range(4 * timeout):
                sock.sendall(b" ")
                time.sleep(0.5)
        except (BrokenPipeError, ConnectionResetError):
            pass
        took, sent = closed_within(sock, timeout + 8 - (time.monotonic() - start))
        assert b" 408 " in sent.split(b"\r\n")[0] and b"serve.client_timeout" in sent, sent
    status, body = post(f"{base}/invocations", RECORD)
    assert status == 200, body
