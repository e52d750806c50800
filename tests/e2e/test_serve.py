"""Serving the registered champion: `crucible serve` (MLflow's scoring app behind the request limits
of params' serve section, under uvicorn) on a free port on 127.0.0.1 answers /invocations with the
in-process predictions, bad requests get HTTP 400 with a clear message, not a 500 with a traceback,
requests over a limit are refused (413 for the body, before it is read; 400 for rows and characters)
naming the limit and its param, and the server answers afterwards; `crucible predict` answers
without a server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.workspaces import registered_workspace, test_texts

from tasks.registry.serving import free_port, stop_server, wait_until_serving

BIN = Path(sys.executable).parent
WAIT_S = 180  # loading torch, mlflow and the model on a busy 2-core machine


def post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return registered_workspace(tmp_path_factory)


@pytest.fixture(scope="module")
def server(ws, tmp_path_factory):
    """`crucible serve` on a free port, in its own process group; stopped by its PID at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [str(BIN / "crucible"), "serve", "--root", str(ws), "--port", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ws,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_serving(base, proc, WAIT_S, log) < WAIT_S + 1  # raises with the log if it never answers
        yield base, log, proc
    finally:
        stop_server(proc)


def worker_rss_mb(proc, port: int) -> float:
    """Resident memory of the server process that listens on `port` (the uvicorn worker)."""
    import psutil

    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp")):
            return p.memory_info().rss / 2**20
    raise AssertionError(f"no process of the server listens on {port}")


def test_served_model_answers_like_the_in_process_one(ws, server):
    from tasks.registry.serving import invocation_body, load_registered

    base, log, proc = server
    printed = log.read_text()
    assert f"at {base}/invocations" in printed and f"curl -s {base}/invocations" in printed
    import psutil

    server = psutil.Process(proc.pid)  # one process: crucible serve became the server
    assert server.children(recursive=True) == [] and "tasks.registry.serving_http" in server.cmdline()
    for _ in range(20):  # the worker says when it answers
        if f"ready: {base}" in log.read_text():
            break
        time.sleep(0.25)
    assert f"ready: {base}" in log.read_text()
    texts = test_texts(ws)
    status, body = post(f"{base}/invocations", invocation_body(list(zip(texts["text"], texts["task"]))))
    assert status == 200, body
    served = pd.DataFrame(body["predictions"])
    model, _ = load_registered(ws, "champion")
    local = model.predict(texts[["text", "task"]])
    assert list(served.columns) == list(local.columns)
    assert served["label"].tolist() == local["label"].tolist()
    for c in [c for c in local.columns if c.startswith("proba_")]:
        a, b = local[c].astype(float).to_numpy(), served[c].astype(float).to_numpy()  # JSON null -> NaN
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.allclose(a[~np.isnan(a)], b[~np.isnan(b)], atol=1e-6), c
    # the records layout works too
    status, body = post(f"{base}/invocations", {"dataframe_records": [{"text": "a great film", "task": "rotten"}]})
    assert status == 200 and body["predictions"][0]["label"] in ("fresh", "rotten")
    assert body["predictions"][0]["proba_sport"] is None


@pytest.mark.parametrize(
    "data, columns, message",
    [
        (
            [["a great film"]],
            ["text"],
            "input is missing column 'task': every row needs a 'text' and a 'task' (one of: rotten, bbc)",
        ),
        ([["a great film", "tweets"]], ["text", "task"], "row 0: unknown task 'tweets'; valid tasks: rotten, bbc"),
        ([["a great film", "rotten"], ["", "bbc"]], ["text", "task"], "row 1: column 'text' is empty"),
        ([[42, "bbc"]], ["text", "task"], "row 0: column 'text' must be a string, got int 42"),
    ],
)
def test_bad_requests_get_400_with_a_clear_message(server, data, columns, message):
    base, _, _ = server
    status, body = post(f"{base}/invocations", {"dataframe_split": {"columns": columns, "data": data}})
    assert status == 400, body
    assert body["error_code"] == "INVALID_PARAMETER_VALUE" and message in body["message"]
    assert "stack_trace" not in body and "Traceback" not in body["message"]


def post_declared(port: int, body: bytes, declared: int) -> tuple[int, dict]:
    """POST with a Content-Length of `declared` bytes but only `body` sent: a server that read the
    body before judging its size would wait for the rest."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/invocations")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(declared))
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before taking it all: read the answer
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_requests_over_the_limits_are_refused_and_the_server_still_answers(ws, server):
    """params' serve section: serve.max_body_bytes (413 before the body is read: the server answers a
    declared 4 MiB body of which 1 KB is sent at once), serve.max_rows and serve.max_chars (400 before
    the model sees the rows), with the param named; nothing is truncated; then a normal request
    still gets its predictions."""
    import yaml

    limits = yaml.safe_load((ws / "params.yaml").read_text())["serve"]
    base, log, proc = server
    assert "serve.max_rows" in log.read_text()  # crucible serve states the limits it serves under
    port = int(base.rsplit(":", 1)[1])
    status, body = post_declared(port, b"{" + b" " * 1023, 4 * limits["max_body_bytes"])
    assert status == 413 and body["error_code"] == "REQUEST_LIMIT_EXCEEDED", body
    assert f"the limit is {limits['max_body_bytes']} bytes (serve.max_body_bytes)" in body["message"]
    big = json.dumps(
        {"dataframe_split": {"columns": ["text", "task"], "data": [["x" * (limits["max_body_bytes"] + 10), "bbc"]]}}
    ).encode()
    status, body = post_declared(port, big, len(big))  # answered before the client is done sending
    assert status == 413 and "serve.max_body_bytes" in body["message"]
    rows = [["a great film", "rotten"]] * (limits["max_rows"] + 1)
    status, body = post(f"{base}/invocations", {"dataframe_split": {"columns": ["text", "task"], "data": rows}})
    assert status == 400 and body["error_code"] == "INVALID_PARAMETER_VALUE", body
    assert body["message"] == (
        f"request has {limits['max_rows'] + 1} rows; the limit is {limits['max_rows']} rows per "
        f"request (serve.max_rows). Split it into requests of at most {limits['max_rows']} rows"
    )
    long = "a great film " * (limits["max_chars"] // 13 + 1)
    status, body = post(
        f"{base}/invocations",
        {"dataframe_records": [{"text": "fine", "task": "rotten"}, {"text": long, "task": "rotten"}]},
    )
    assert status == 400 and body["message"].startswith(
        f"row 1: column 'text' has {len(long)} characters; the limit is {limits['max_chars']} characters per text "
        f"(serve.max_chars)"
    ), body
    # the same limits hold for a CSV body, checked on the parsed table
    csv = "text,task\n" + "".join("a fine film,rotten\n" for _ in range(limits["max_rows"] + 1))
    req = urllib.request.Request(f"{base}/invocations", data=csv.encode(), headers={"Content-Type": "text/csv"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400 and "serve.max_rows" in json.loads(err.value.read())["message"]
    # at the limits exactly: answered
    status, body = post(
        f"{base}/invocations",
        {
            "dataframe_split": {
                "columns": ["text", "task"],
                "data": [["x" * limits["max_chars"], "bbc"], *[["a great film", "rotten"]] * (limits["max_rows"] - 1)],
            }
        },
    )
    assert status == 200 and len(body["predictions"]) == limits["max_rows"]
    status, body = post(f"{base}/invocations", {"dataframe_records": [{"text": "a great film", "task": "rotten"}]})
    assert status == 200 and body["predictions"][0]["label"] in ("fresh", "rotten")
    # hostile requests, again and again: refused before they are read or reach the model, so the
    # worker's memory stays where the largest request it answered (at the limits, above) left it
    huge = json.dumps({"dataframe_split": {"columns": ["text", "task"], "data": [["x" * (8 << 20), "bbc"]]}}).encode()
    before = None
    for round in range(6):  # the first round warms up; the next five must not grow the worker
        status, body = post_declared(port, huge, len(huge))  # an 8 MB text
        assert status == 413 and "serve.max_body_bytes" in body["message"], body
        assert post(f"{base}/invocations", {"dataframe_split": {"columns": ["text", "task"], "data": rows}})[0] == 400
        assert post(f"{base}/invocations", {"dataframe_records": [{"text": long, "task": "rotten"}]})[0] == 400
        before = worker_rss_mb(proc, port) if round == 0 else before
    grown = worker_rss_mb(proc, port) - before
    assert grown < 20, f"the worker grew by {grown:.0f} MB under refused requests"


def test_predict_cli_answers_from_the_champion(ws, capsys):
    from flows.cli import build_parser

    args = build_parser().parse_args(
        ["predict", "--root", str(ws), "--task", "bbc", "--json", "goal for the team", "chip prices"]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in out] == ["goal for the team", "chip prices"]
    assert all(
        r["label"] in ("business", "sport", "tech")
        and set(r) == {"text", "task", "label", "proba_business", "proba_sport", "proba_tech"}
        for r in out
    )
    args = build_parser().parse_args(["predict", "--root", str(ws), "--task", "tweets", "hello"])
    assert args.func(args) == 2
    assert "unknown task 'tweets'; valid tasks: rotten, bbc" in capsys.readouterr().err


@pytest.mark.parametrize(
    "doc, rows, texts",
    [
        ({"dataframe_split": {"columns": ["task", "text"], "data": [["bbc", "a"], ["bbc", "bb"]]}}, 2, ["a", "bb"]),
        ({"dataframe_records": [{"text": "a", "task": "bbc"}, {"task": "bbc"}]}, 2, ["a", None]),
        ({"instances": [{"text": "abc", "task": "bbc"}]}, 1, ["abc"]),
        ({"inputs": {"text": ["a", "b", "c"], "task": ["bbc", "bbc", "bbc"]}}, 3, ["a", "b", "c"]),
        ({"something": 1}, None, None),
    ],
)
def test_the_limits_read_every_json_layout_mlflow_takes(doc, rows, texts):
    from tasks.registry.serving_app import json_rows, limit_problem

    found = json_rows(json.dumps(doc).encode())
    assert found == (None if rows is None else (rows, texts))
    if found:
        assert limit_problem(found[0], found[1], rows, 3) is None  # at the limits: fine
        assert "(serve.max_rows)" in limit_problem(found[0], found[1], rows - 1, 3) if rows > 1 else True
        assert "(serve.max_chars)" in (limit_problem(found[0], found[1], rows, 0) or "")
    assert json_rows(b"not json") is None


def post_raw(port: int, body: bytes, headers: dict) -> tuple[int, bytes]:
    """POST /invocations with exactly these headers (http.client adds no Content-Type of its own)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/invocations", body=body, headers={"Content-Length": str(len(body)), **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_missing_or_unsupported_content_type_and_deep_json_get_400_not_500(server):
    """No Content-Type, one the server does not read, JSON nested 1000 levels deep: HTTP 400 with a
    JSON message (naming the nesting limit), no 500, no traceback in the server's log."""
    from tasks.registry.serving import invocation_body

    base, log, _ = server
    port = int(base.rsplit(":", 1)[1])
    good = json.dumps(invocation_body([("a great film", "rotten")])).encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/json; charset=latin-1"}):
        status, raw = post_raw(port, good, headers)
        assert status == 400, (headers, status, raw)
        message = json.loads(raw)["message"]
        assert "Content-Type" in message and "application/json" in message, message
    deep = b'{"dataframe_split": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    status, raw = post_raw(port, deep, {"Content-Type": "application/json"})
    assert status == 400, (status, raw[:300])
    body = json.loads(raw)
    assert body["error_code"] == "INVALID_PARAMETER_VALUE" and "nested" in body["message"], body
    from tasks.registry.serving_app import MAX_JSON_DEPTH

    assert f"the limit is {MAX_JSON_DEPTH} levels" in body["message"]
    assert post(f"{base}/invocations", invocation_body([("a great film", "rotten")]))[0] == 200
    assert "Traceback" not in log.read_text()


def test_json_depth_skips_brackets_inside_strings():
    from tasks.registry.serving_app import json_depth

    assert json_depth(b'{"a": [[1, 2], [3]]}') == 3
    assert json_depth(b'{"a": "[[[[[[{{{{", "b": "\\"[[["}') == 1
    assert json_depth(b"[" * 5000) == 5000
    assert json_depth(b'["unterminated \\" [[[[') == 1
    assert json_depth(b"") == 0


def test_a_non_loopback_host_is_warned_about(tmp_path, capsys):
    """`crucible serve --host 0.0.0.0` says on stderr that it exposes the model to the network, with
    no authentication; 127.0.0.1, ::1 and localhost say nothing."""
    from flows.cli import build_parser
    from flows.servers import exposure_warning

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.10"):
        warning = exposure_warning(host)
        assert warning and "network" in warning and "no authentication" in warning and host in warning
    args = build_parser().parse_args(["serve", "--root", str(tmp_path), "--host", "0.0.0.0"])
    args.func(args)  # no workspace here: it stops with an error, after the warning
    err = capsys.readouterr().err
    assert "no authentication" in err and err.index("no authentication") < err.index("error:")
