"""The HTTP app that `crucible serve` runs under uvicorn: MLflow's own scoring app
(mlflow.pyfunc.scoring_server: /invocations, /ping, /health, /version) for one downloaded model
version, behind the request limits of params' `serve` section.

    CRUCIBLE_SERVE_MODEL=<model folder> CRUCIBLE_SERVE_LIMITS='{"max_rows": 256, ...}' \\
        python -m uvicorn --factory tasks.registry.serving_app:create_app --host 127.0.0.1 --port 5001

Limits, each refused with a message naming the limit and its param, nothing truncated:
- the body (`serve.max_body_bytes`): a declared Content-Length over the limit is answered 413 before
  a byte of the body is read; a body without a length (chunked) is read only up to the limit, then
  answered 413. So no parser ever sees more than max_body_bytes;
- rows and characters (`serve.max_rows`, `serve.max_chars`): a JSON body is checked before MLflow
  turns it into a table, any other (CSV, parquet) on the parsed table, always before the model sees
  it (before tokenizing): HTTP 400 with error code INVALID_PARAMETER_VALUE, like every other bad
  input, naming the row of a text that is too long;
- connections and requests in flight (`serve.max_concurrency`): uvicorn's --limit-concurrency, 503.

This module imports neither crucible nor the rest of `tasks`: the model is loaded with the library
code it was logged with (its `code_paths`), as `mlflow models serve` would load it.
"""

from __future__ import annotations

import json
import os

MODEL_ENV = "CRUCIBLE_SERVE_MODEL"
LIMITS_ENV = "CRUCIBLE_SERVE_LIMITS"
ANNOUNCE_ENV = "CRUCIBLE_SERVE_URL"  # where the server answers: each worker says `ready: <url>` once it does
LIMITS = ("max_rows", "max_chars", "max_body_bytes", "max_concurrency")


def _json_error(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error_code": code, "message": message}).encode()


def json_rows(body: bytes) -> tuple[int, list] | None:
    """(rows, texts) of a JSON /invocations body in one of MLflow's layouts (dataframe_split,
    dataframe_records, instances, inputs); None when it is not one (MLflow then says what is wrong)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
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
    MLflow's errors) without reading it, or as soon as the bytes read pass the limit; a JSON
    /invocations body over the row or character limit is answered 400 before MLflow parses it into a
    table (other content types are checked on the parsed table: LimitedModel)."""

    def __init__(self, app, max_bytes: int, max_rows: int, max_chars: int, param: str = "serve.max_body_bytes"):
        self.app, self.max_bytes, self.param = app, int(max_bytes), param
        self.max_rows, self.max_chars = int(max_rows), int(max_chars)

    def _too_large(self, size: str) -> tuple[int, bytes]:
        return _json_error(
            413,
            "REQUEST_LIMIT_EXCEEDED",
            f"request body {size}; the limit is {self.max_bytes} bytes ({self.param}). Send fewer "
            f"or shorter texts per request",
        )

    async def _answer(self, send, status: int, body: bytes) -> None:
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

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await self._answer(
                    send, *_json_error(400, "BAD_REQUEST", f"Content-Length {declared[:40]!r} is not a number")
                )
            if size > self.max_bytes:
                return await self._answer(send, *self._too_large(f"of {size} bytes (Content-Length)"))
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return await self._answer(send, *self._too_large(f"of more than {self.max_bytes} bytes"))
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False
        kind = dict(scope.get("headers") or []).get(b"content-type", b"").split(b";")[0].strip()
        if scope.get("path", "").rstrip("/").endswith("/invocations") and kind == b"application/json":
            found = json_rows(body)
            problem = found and limit_problem(found[0], found[1], self.max_rows, self.max_chars)
            if problem:
                return await self._answer(send, *_json_error(400, "INVALID_PARAMETER_VALUE", problem))

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
    return RequestLimits(app, limits["max_body_bytes"], limits["max_rows"], limits["max_chars"])
