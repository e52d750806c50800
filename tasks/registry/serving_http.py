"""The process `crucible serve` becomes: uvicorn running the serving app (tasks/registry/serving_app.py)
with the connection limits of params' `serve` section, which uvicorn's own options cannot set:

- `serve.client_timeout`: a connection has that many seconds to send a request's headers, counted
  from when it opens or from the end of its last answer; bytes trickling in do not extend it. An
  idle connection is then closed, one that sent part of a request gets 408 naming the param. (The
  body gets as long again: serving_app.RequestLimits.) uvicorn times out only keep-alive connections
  that send nothing after an answer, so a socket that connects and waits held a slot for good;
- `serve.max_concurrency`: connections open and requests in flight per worker; the request that
  makes it one more gets a JSON 503 naming the param (uvicorn's --limit-concurrency answers a bare
  `Service Unavailable` one connection early).

    CRUCIBLE_SERVE_MODEL=<model folder> CRUCIBLE_SERVE_LIMITS='{"max_rows": 256, ...}' \\
        python -m tasks.registry.serving_http --host 127.0.0.1 --port 5001
"""

from __future__ import annotations

import os

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tasks.registry.serving_app import LIMITS_ENV, _json_error, read_limits, send_json

PROTOCOL = "tasks.registry.serving_http:LimitedH11Protocol"  # as uvicorn imports it in each worker


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose connections get `config.timeout_keep_alive` seconds to send a
    request's headers (serve.client_timeout), and whose requests over `config.limit_concurrency`
    (serve.max_concurrency) get a 503 naming it."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.max_concurrency, self.limit_concurrency = config.limit_concurrency, None  # ours answers, not uvicorn's
        self.inner_app, self.app = self.app, self.limited_app
        self.headers_due = None  # the timer of the request whose headers are awaited
        self.busy = None  # (connections, requests in flight) when this connection's request came over the limit

    async def limited_app(self, scope, receive, send) -> None:
        busy, self.busy = self.busy, None
        if busy:
            open_, flying = busy
            self.logger.warning("refused a request: %d connections, %d requests in flight", open_, flying)
            return await send_json(
                send,
                *_json_error(
                    503,
                    "TEMPORARILY_UNAVAILABLE",
                    f"server busy: {open_} connections open and {flying} requests in flight with this one; the "
                    f"limit is {self.max_concurrency} of each per worker (serve.max_concurrency). Retry shortly",
                ),
            )
        return await self.inner_app(scope, receive, send)

    def _await_headers(self) -> None:
        self._headers_in()
        self.headers_due = self.loop.call_later(self.timeout_keep_alive, self._headers_late)

    def _headers_in(self) -> None:
        if self.headers_due is not None:
            self.headers_due.cancel()
            self.headers_due = None

    def _headers_late(self) -> None:
        self.headers_due = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request is being answered: its body's time is RequestLimits' to keep
        received = self.conn.trailing_data[0]
        if received and self.conn.their_state is h11.IDLE:  # part of a request came: say why it is cut off
            self.logger.warning("closed a connection: request headers incomplete after %s s", self.timeout_keep_alive)
            _, body = _json_error(
                408,
                "REQUEST_TIMEOUT",
                f"request headers incomplete after {self.timeout_keep_alive} s ({len(received)} bytes came); the "
                f"limit is {self.timeout_keep_alive} s (serve.client_timeout). Send the whole request at once",
            )
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_headers()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.max_concurrency is not None:
            # a request came and its task is counted, with this connection: judged now, as uvicorn
            # would, the requests that come after it do not count against it
            counts = len(self.connections), len(self.tasks)
            self.busy = counts if max(counts) > self.max_concurrency else None
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in
            self._headers_in()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request: _headers_late lets it be
        if not self.transport.is_closing():
            self._await_headers()

    def connection_lost(self, exc) -> None:
        self._headers_in()
        super().connection_lost(exc)


def main(argv: list[str] | None = None) -> None:
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m tasks.registry.serving_http", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    limits = read_limits(os.environ.get(LIMITS_ENV))
    uvicorn.run(
        "tasks.registry.serving_app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        http=PROTOCOL,
        limit_concurrency=limits["max_concurrency"],
        timeout_keep_alive=limits["client_timeout"],
    )


if __name__ == "__main__":
    main()
