"""The HTTP app that `crucible serve` runs under uvicorn: MLflow's own scoring app
(mlflow.pyfunc.scoring_server: /invocations, /ping, /health, /version) for one downloaded model
version, behind the request limits of params' `serve` section.

    CRUCIBLE_SERVE_MODEL=<model folder> CRUCIBLE_SERVE_LIMITS='{"max_rows": 256, ...}' \\
        python -m tasks.registry.serving_http --host 127.0.0.1 --port 5001  # uvicorn, + connection limits

Limits, each refused with a message naming the limit and its param, nothing truncated:
- the body (`serve.max_body_bytes`): a declared Content-Length over the limit is answered 413 before
  a byte of the body is read; a body without a length (chunked) is read only up to the limit, then
  answered 413. So no parser ever sees more than max_body_bytes;
- rows and characters (`serve.max_rows`, `serve.max_chars`): a JSON body is checked before MLflow
  turns it into a table, any other (CSV, parquet) on the parsed table, always before the model sees
  it (before tokenizing): HTTP 400 with error code INVALID_PARAMETER_VALUE, like every other bad
  input, naming the row of a text that is too long;
- connections and requests in flight (`serve.max_concurrency`): 503; a connection has
  `serve.client_timeout` seconds to send a request's headers (tasks/registry/serving_http.py), then
  as many for its body (here): 408, so idle or slow clients cannot hold the slots.
Malformed requests get 400 with a message too: an /invocations body without a Content-Type the app
reads, or JSON nested deeper than MAX_JSON_DEPTH (refused before it is parsed).

This module imports neither crucible nor the rest of `tasks`: the model is loaded with the library
code it was logged with (its `code_paths`), as `mlflow models serve` would load it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

MODEL_ENV = "CRUCIBLE_SERVE_MODEL"
LIMITS_ENV = "CRUCIBLE_SERVE_LIMITS"
ANNOUNCE_ENV = "CRUCIBLE_SERVE_URL"  # where the server answers: each worker says `ready: <url>` once it does
LIMITS = ("max_rows", "max_chars", "max_body_bytes", "max_concurrency", "client_timeout")
# the body types MLflow's app reads (utf-8 only); anything else is refused before the body is read
CONTENT_TYPES = ("application/json", "text/csv", "application/vnd.apache.parquet")
MAX_JSON_DEPTH = 16  # levels of [ and { in a JSON body; /invocations needs 4 (dataframe_split's rows)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)  # an unterminated one runs to the end
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def _json_error(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error_code": code, "message": message}).encode()


async def send_json(send, status: int, body: bytes) -> None:
    """An ASGI answer with this JSON body, closing the connection (the shape of MLflow's errors)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def json_depth(body: bytes) -> int:
    """How deep `[` and `{` nest in a JSON text (those inside strings not counted), found without
    parsing it: a parser recurses once per level."""
    import numpy as np

    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    return int(np.cumsum(np.frombuffer(brackets.translate(_STEP), dtype=np.int8), dtype=np.int64).max())


def content_type_problem(value: bytes | None) -> tuple[str | None, str | None]:
    """(the media type MLflow's app is to see, None) for a Content-Type it reads; (None, what is
    wrong) for a missing one, another media type or a charset other than utf-8."""
    accepted = f"send one of: {', '.join(CONTENT_TYPES)} (utf-8)"
    if not value or not value.strip():
        return None, f"the request has no Content-Type header; {accepted}"
    mime, *rest = [part.strip() for part in value.decode("latin-1").split(";")]
    if mime.lower() not in CONTENT_TYPES:
        return None, f"Content-Type {mime[:80]!r} is not read here; {accepted}"
    for part in rest:
        key, _, val = part.partition("=")
        if key.strip().lower() != "charset" or val.strip().strip('"').lower() != "utf-8":
            return None, f"Content-Type parameter {part[:80]!r} is not read here; {accepted}"
    return mime.lower(), None


def json_rows(body: bytes) -> tuple[int, list] | None:
    """(rows, texts) of a JSON /invocations body in one of MLflow's layouts (dataframe_split,
    dataframe_records, instances, inputs); None when it is not one (MLflow then says what is wrong)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("dataframe_split"), dict):
        split = doc["dataframe_split"]
        data, columns = split.get("data"), split.get("columns")
        if not isinstance(data, list):
            return None
        k = columns.index("text") if isinstance(columns, list) and "text" in columns else None
        return len(data), [r[k] for r in data if k is not None and isinstance(r, list) and len(r) > k]
    for key in ("dataframe_records", "instances", "inputs"):
        value = doc.get(key)
        if isinstance(value, list):
            return len(value), [r.get("text") for r in value if isinstance(r, dict)]
        if isinstance(value, dict):
            columns = [v for v in value.values() if isinstance(v, list)]
            texts = value.get("text")
            return (max(map(len, columns)) if columns else 1), (texts if isinstance(texts, list) else [texts])
    return None


def limit_problem(n: int, texts, max_rows: int, max_chars: int) -> str | None:
    """What a request of `n` rows with these texts breaks, naming the limit and its param; None if nothing."""
    if n > max_rows:
        return (
            f"request has {n} rows; the limit is {max_rows} rows per request (serve.max_rows). "
            f"Split it into requests of at most {max_rows} rows"
        )
    for i, text in enumerate(texts):
        if isinstance(text, str) and len(text) > max_chars:
            return (
                f"row {i}: column 'text' has {len(text)} characters; the limit is {max_chars} characters per "
                f"text (serve.max_chars). Shorten it; nothing is truncated for you"
            )
    return None


class RequestLimits:
    """ASGI middleware: a POST body larger than `max_bytes` is answered 413 (JSON, the shape of
    MLflow's errors) without reading it, or as soon as the bytes read pass the limit; one that has not
    all come within `timeout` seconds, 408. At /invocations a Content-Type MLflow's app does not read
    is answered 400 before the body is read; a JSON body nested deeper than MAX_JSON_DEPTH, or over
    the row or character limit, 400 before anything parses it into a table (other content types are
    checked on the parsed table: LimitedModel)."""

    def __init__(
        self,
        app,
        max_bytes: int,
        max_rows: int,
        max_chars: int,
        timeout: float = 5,
        param: str = "serve.max_body_bytes",
    ):
        self.app, self.max_bytes, self.param = app, int(max_bytes), param
        self.max_rows, self.max_chars, self.timeout = int(max_rows), int(max_chars), timeout

    def _too_large(self, size: str) -> tuple[int, bytes]:
        return _json_error(
            413,
            "REQUEST_LIMIT_EXCEEDED",
            f"request body {size}; the limit is {self.max_bytes} bytes ({self.param}). Send fewer "
            f"or shorter texts per request",
        )

    async def _read(self, receive) -> tuple[bytes | None, tuple[int, bytes] | None]:
        """(the body, None), (None, the answer to give instead) or (None, None) if the client left."""
        chunks, total = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None, None
                    chunk = message.get("body", b"")
                    total += len(chunk)
                    if total > self.max_bytes:
                        return None, self._too_large(f"of more than {self.max_bytes} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body"):
                        return b"".join(chunks), None
        except TimeoutError:
            return None, _json_error(
                408,
                "REQUEST_TIMEOUT",
                f"request body incomplete after {self.timeout:g} s ({total} bytes came); the limit is "
                f"{self.timeout:g} s (serve.client_timeout). Send the whole request at once",
            )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await send_json(
                    send, *_json_error(400, "BAD_REQUEST", f"Content-Length {declared[:40]!r} is not a number")
                )
            if size > self.max_bytes:
                return await send_json(send, *self._too_large(f"of {size} bytes (Content-Length)"))
        kind = None
        if scope.get("path", "").rstrip("/").endswith("/invocations"):
            kind, problem = content_type_problem(headers.get(b"content-type"))
            if problem:
                return await send_json(send, *_json_error(400, "BAD_REQUEST", problem))
            # MLflow's app compares the media type exactly: it sees the one it reads
            scope = {
                **scope,
                "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                + [(b"content-type", kind.encode())],
            }
        body, answer = await self._read(receive)
        if answer:
            return await send_json(send, *answer)
        if body is None:
            return
        if kind == "application/json":
            depth = json_depth(body)
            problem = (
                f"request JSON is nested {depth} levels deep; the limit is {MAX_JSON_DEPTH} levels (an "
                f"/invocations body needs 4)"
                if depth > MAX_JSON_DEPTH
                else None
            )
            found = None if problem else json_rows(body)
            problem = problem or (found and limit_problem(found[0], found[1], self.max_rows, self.max_chars))
            if problem:
                return await send_json(send, *_json_error(400, "INVALID_PARAMETER_VALUE", problem))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _invalid(message: str):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def check_rows(data, max_rows: int, max_chars: int) -> None:
    """Refuse (MlflowException INVALID_PARAMETER_VALUE: HTTP 400) a parsed request of more than
    `max_rows` rows or with a text of more than `max_chars` characters, naming the limit, its param
    and the row. Anything else (no text column, a non-string text) is the model's to judge."""
    import pandas as pd

    if isinstance(data, dict):
        lengths = {len(v) for v in data.values() if isinstance(v, (list, tuple))}
        n, texts = (max(lengths) if lengths else 1), data.get("text")
    elif isinstance(data, pd.DataFrame):
        n, texts = len(data), data["text"] if "text" in data.columns else None
    else:
        n, texts = (len(data) if hasattr(data, "__len__") else 1), None
    if texts is None or isinstance(texts, str):
        texts = [texts] if isinstance(texts, str) else []
    problem = limit_problem(n, texts, max_rows, max_chars)
    if problem:
        raise _invalid(problem)


class LimitedModel:
    """A loaded pyfunc whose predict refuses requests over the row and character limits before the
    model sees them (MLflow's scoring app calls `predict(data, params=...)` and reads `metadata`)."""

    def __init__(self, model, max_rows: int, max_chars: int):
        self._model, self.max_rows, self.max_chars = model, int(max_rows), int(max_chars)
        self.metadata = model.metadata

    def predict(self, data, params=None):
        check_rows(data, self.max_rows, self.max_chars)
        return self._model.predict(data, params=params)

    def __getattr__(self, name):
        return getattr(self._model, name)


def read_limits(text: str | None) -> dict:
    """The limits from their JSON (CRUCIBLE_SERVE_LIMITS); every one must be there, a positive int."""
    try:
        limits = json.loads(text or "")
    except json.JSONDecodeError:
        limits = None
    if not isinstance(limits, dict) or any(not isinstance(limits.get(k), int) or limits[k] < 1 for k in LIMITS):
        raise ValueError(
            f"{LIMITS_ENV} must be a JSON object of positive integers {', '.join(LIMITS)}; "
            f"got {text!r} (`crucible serve` sets it from params' serve section)"
        )
    return limits


def announce(url: str, timeout: float = 600) -> None:
    """Print `ready: <url>` once <url>/ping answers (uvicorn binds its port only after the app is
    built, so the factory cannot say it itself)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as resp:
                if resp.status == 200:
                    print(f"ready: {url}", flush=True)
                    return
        except OSError:
            pass
        time.sleep(0.3)


def create_app():
    """uvicorn's app factory: the model folder of CRUCIBLE_SERVE_MODEL behind the limits of
    CRUCIBLE_SERVE_LIMITS."""
    import threading

    from mlflow.pyfunc import scoring_server

    limits = read_limits(os.environ.get(LIMITS_ENV))
    model = scoring_server.load_model_with_mlflow_config(os.environ[MODEL_ENV])
    app = scoring_server.init(LimitedModel(model, limits["max_rows"], limits["max_chars"]))
    if os.environ.get(ANNOUNCE_ENV):
        threading.Thread(target=announce, args=(os.environ[ANNOUNCE_ENV],), daemon=True).start()
    return RequestLimits(
        app, limits["max_body_bytes"], limits["max_rows"], limits["max_chars"], limits["client_timeout"]
    )
