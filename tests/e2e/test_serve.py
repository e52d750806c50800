"""Serving the registered champion: `crucible serve` (mlflow models serve) on a free port on
127.0.0.1 answers /invocations with the in-process predictions, and bad requests get HTTP 400 with
a clear message, not a 500 with a traceback; `crucible predict` answers without a server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tasks.registry.serving import free_port, stop_server, wait_until_serving
from support.workspaces import registered_workspace, test_texts

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
        proc = subprocess.Popen([str(BIN / "crucible"), "serve", "--root", str(ws), "--port", str(port)],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=ws)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_serving(base, proc, WAIT_S, log) < WAIT_S + 1  # raises with the log if it never answers
        yield base, log
    finally:
        stop_server(proc)


def test_served_model_answers_like_the_in_process_one(ws, server):
    from tasks.registry.serving import invocation_body, load_registered

    base, log = server
    printed = log.read_text()
    assert f"at {base}/invocations" in printed and f"curl -s {base}/invocations" in printed
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


@pytest.mark.parametrize("data, columns, message", [
    ([["a great film"]], ["text"], "input is missing column 'task': every row needs a 'text' and a 'task' (one of: rotten, bbc)"),
    ([["a great film", "tweets"]], ["text", "task"], "row 0: unknown task 'tweets'; valid tasks: rotten, bbc"),
    ([["a great film", "rotten"], ["", "bbc"]], ["text", "task"], "row 1: column 'text' is empty"),
    ([[42, "bbc"]], ["text", "task"], "row 0: column 'text' must be a string, got int 42"),
])
def test_bad_requests_get_400_with_a_clear_message(server, data, columns, message):
    base, _ = server
    status, body = post(f"{base}/invocations", {"dataframe_split": {"columns": columns, "data": data}})
    assert status == 400, body
    assert body["error_code"] == "INVALID_PARAMETER_VALUE" and message in body["message"]
    assert "stack_trace" not in body and "Traceback" not in body["message"]


def test_predict_cli_answers_from_the_champion(ws, capsys):
    from flows.cli import build_parser

    args = build_parser().parse_args(["predict", "--root", str(ws), "--task", "bbc", "--json", "goal for the team",
                                      "chip prices"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in out] == ["goal for the team", "chip prices"]
    assert all(r["label"] in ("business", "sport", "tech") and set(r) == {"text", "task", "label", "proba_business",
                                                                            "proba_sport", "proba_tech"} for r in out)
    args = build_parser().parse_args(["predict", "--root", str(ws), "--task", "tweets", "hello"])
    assert args.func(args) == 2
    assert "unknown task 'tweets'; valid tasks: rotten, bbc" in capsys.readouterr().err
