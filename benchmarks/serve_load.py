"""A bounded load test of `crucible serve`: latency percentiles, the server's memory before and after,
and hostile requests that must be refused.

    python benchmarks/serve_load.py --root build/tiny                       # the champion
    python benchmarks/serve_load.py --root build/tiny --requests 300 --seconds 120 --concurrency 4

It starts `crucible serve` on a free port of 127.0.0.1 (stopped by its process group at the end),
waits until it answers, and measures the resident memory (RSS) of every process of the server (the
`crucible serve` process and its children; the worker is the one that listens on the port). Then:

1. normal load: at most --requests requests of 1 to --max-rows texts (the tasks' test texts, mixed)
   from --concurrency client threads, stopped after --seconds whatever the count; latency p50,
   p95 and p99 of the requests that got an answer;
2. hostile requests, --hostile rounds of each: a body of --huge-mb MB (one text of that size), a
   text one character over the text limit, one row over the row limit, and a body declared larger
   than the body limit; each must be refused (HTTP 4xx) and none may take the server down;
3. RSS again, and one normal request to check that the server still answers.

The limits are read from the workspace's params (`serve` section). Bounded in count and time; binds
nothing but the server on 127.0.0.1. Prints a report (and --json writes it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_mb(root_pid: int, port: int) -> dict:
    """RSS (MB) of the server's process tree: total, the worker (listening on `port`), each process."""
    import psutil

    try:
        top = psutil.Process(root_pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"total": float("nan"), "worker": float("nan"), "processes": []}
    out, worker = [], None
    for p in procs:
        try:
            rss = p.memory_info().rss / 2**20
            name = " ".join(p.cmdline()[1:4])[:60]
            listening = any(
                c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                for c in p.net_connections(kind="tcp")
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out.append({"pid": p.pid, "rss_mb": round(rss, 1), "cmd": name, "worker": listening})
        if listening:
            worker = rss
    return {
        "total": round(sum(p["rss_mb"] for p in out), 1),
        "worker": round(worker, 1) if worker else None,
        "processes": out,
    }


def post(port: int, body: bytes, declared: int | None = None, timeout: float = 120) -> tuple[int, str, float]:
    """(status, the response's first 300 characters, seconds). Status 0: the connection failed
    (the message says how). `declared`: a Content-Length other than the body's (a client that
    announces more than it sends)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest("POST", "/invocations")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(declared if declared is not None else len(body)))
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: read its answer
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        return resp.status, text[:300], time.perf_counter() - start
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    finally:
        conn.close()


def body_of(rows: list[tuple[str, str]]) -> bytes:
    return json.dumps({"dataframe_split": {"columns": ["text", "task"], "data": [list(r) for r in rows]}}).encode()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the workspace (its registry, params and data/)")
    parser.add_argument("--alias", default="champion", help="alias or version number")
    parser.add_argument("--requests", type=int, default=200, help="at most this many normal requests")
    parser.add_argument("--seconds", type=float, default=120, help="and for at most this long")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--max-rows", type=int, default=16, help="texts per normal request: 1 to this")
    parser.add_argument("--hostile", type=int, default=3, help="rounds of each hostile request")
    parser.add_argument("--huge-mb", type=float, default=8.0, help="size of the one-text hostile body")
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for the server to answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.requests > 5000 or args.seconds > 900 or args.concurrency > 32 or args.hostile > 20 or args.huge_mb > 64:
        raise SystemExit(
            "bounded: --requests <= 5000, --seconds <= 900, --concurrency <= 32, --hostile <= 20, --huge-mb <= 64"
        )

    from tasks.runtime.env import apply_defaults

    root = Path(args.root).resolve()
    apply_defaults(root)
    import pandas as pd
    import yaml

    from tasks.registry.serving import free_port, stop_server, wait_until_serving

    raw = yaml.safe_load((root / "params.yaml").read_text()) or {}
    limits = {"max_rows": 256, "max_chars": 10000, "max_body_bytes": 1 << 20, **(raw.get("serve") or {})}
    tasks = list((raw.get("pipeline") or {}).get("tasks") or {})
    pool = [
        (str(r.text), t)
        for t in tasks
        if (root / "data" / t / "test.parquet").is_file()
        for r in pd.read_parquet(root / "data" / t / "test.parquet", columns=["text"]).itertuples()
    ]
    if not pool:
        raise SystemExit(f"{root}/data/<task>/test.parquet: none found for tasks {tasks}")
    rng = random.Random(args.seed)

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="serve-load-")) / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "serve",
                "--root",
                str(root),
                "--alias",
                args.alias,
                "--port",
                str(port),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )
    result: dict = {"root": str(root), "alias": args.alias, "limits": limits}
    try:
        try:
            result["startup_s"] = round(wait_until_serving(f"http://127.0.0.1:{port}", proc, args.wait, log), 1)
        except RuntimeError as exc:
            raise SystemExit(f"{exc}\n(its log: {log})") from None
        status, text, _ = post(port, body_of(pool[:4]))  # warm-up
        if status != 200:
            raise SystemExit(f"warm-up request: HTTP {status}: {text}")
        result["rss_before"] = rss_mb(proc.pid, port)

        # 1. normal load, bounded in count and time
        latencies, statuses, lock = [], {}, threading.Lock()
        deadline = time.monotonic() + args.seconds
        bodies = [
            body_of(rng.sample(pool, rng.randint(1, min(args.max_rows, len(pool))))) for _ in range(args.requests)
        ]
        todo = iter(bodies)

        def client() -> None:
            while time.monotonic() < deadline:
                with lock:
                    body = next(todo, None)
                if body is None:
                    return
                status, _, seconds = post(port, body)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    if status == 200:
                        latencies.append(seconds)

        start = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        result["load"] = {
            "requests": sum(statuses.values()),
            "statuses": statuses,
            "seconds": round(wall, 1),
            "per_second": round(sum(statuses.values()) / wall, 2),
            "latency_ms": {f"p{q}": round(1000 * percentile(latencies, q), 1) for q in (50, 95, 99)},
        }
        result["rss_after_load"] = rss_mb(proc.pid, port)

        # 2. hostile requests: each must be refused with a 4xx, none may take the server down
        huge = int(args.huge_mb * 2**20)
        hostile = {
            f"one text of {args.huge_mb:g} MB": lambda: post(port, body_of([("x" * huge, tasks[0])])),
            f"one text of max_chars + 1 = {limits['max_chars'] + 1} characters": lambda: post(
                port, body_of([(("y " * (limits["max_chars"] // 2 + 1))[: limits["max_chars"] + 1], tasks[0])])
            ),
            f"max_rows + 1 = {limits['max_rows'] + 1} rows": lambda: post(
                port, body_of([pool[i % len(pool)] for i in range(limits["max_rows"] + 1)])
            ),
            "2000 rows": lambda: post(port, body_of([pool[i % len(pool)] for i in range(2000)])),
            f"Content-Length {4 * limits['max_body_bytes']} declared, 1 KB sent": lambda: post(
                port, body_of(pool[:1])[:1024], declared=4 * limits["max_body_bytes"], timeout=30
            ),
        }
        result["hostile"] = {}
        for label, send in hostile.items():
            answers = [send() for _ in range(args.hostile)]
            codes = [a[0] for a in answers]
            result["hostile"][label] = {
                "statuses": codes,
                "refused": all(400 <= c < 500 for c in codes),
                "seconds_max": round(max(a[2] for a in answers), 2),
                "message": answers[0][1][:240],
            }
        status, text, _ = post(port, body_of(pool[:4]))
        result["answers_after"] = status == 200
        result["rss_after"] = rss_mb(proc.pid, port)
    finally:
        stop_server(proc)

    before, after = result["rss_before"], result["rss_after"]
    print(f"crucible serve {result['alias']} of {root}: up in {result['startup_s']} s; limits: {limits}")
    load = result["load"]
    print(
        f"normal load: {load['requests']} requests of 1-{args.max_rows} texts from {args.concurrency} clients in "
        f"{load['seconds']} s ({load['per_second']}/s), statuses {load['statuses']}"
    )
    print(
        f"  latency p50 {load['latency_ms']['p50']} ms, p95 {load['latency_ms']['p95']} ms, "
        f"p99 {load['latency_ms']['p99']} ms"
    )
    print("hostile requests (each must be refused with a 4xx):")
    for label, h in result["hostile"].items():
        print(
            f"  {label:<52} {'refused' if h['refused'] else 'NOT REFUSED'} {h['statuses']} "
            f"(<= {h['seconds_max']} s): {h['message'][:150]!r}"
        )
    print(f"server still answers afterwards: {result['answers_after']}")
    print("RSS (MB)            before   after load   after hostile")
    print(
        f"  worker          {before['worker']!s:>8} {result['rss_after_load']['worker']!s:>12} {after['worker']!s:>15}"
    )
    print(f"  all processes   {before['total']!s:>8} {result['rss_after_load']['total']!s:>12} {after['total']!s:>15}")
    for p in after["processes"]:
        print(f"    pid {p['pid']:<8} {p['rss_mb']:>8.1f} MB  {'worker ' if p['worker'] else ''}{p['cmd']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not all(h["refused"] for h in result["hostile"].values()) or not result["answers_after"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
