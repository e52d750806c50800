"""The registered model served over HTTP against the same pyfunc in process: size and latency.

    python benchmarks/serve_latency.py --root .                    # the champion of this project
    python benchmarks/serve_latency.py --root build/tiny --alias 2

For a workspace whose registry holds the model (after the register stage) it reports
- the served model's weights on disk (models/quantize/ or models/merge/: model + heads) against the
  float merged model's, and the logged pyfunc folder's size;
- its test accuracy per task (the register stage's tags, from evaluate);
- the latency of one request of 1 text and of a batch of 64 texts (median of --repeats, after
  warm-up), through the server `crucible serve` runs (MLflow's scoring app under uvicorn, on
  127.0.0.1; started here, stopped by its PID) and
  through the in-process pyfunc, absolute and as ratios (HTTP / in-process).
Texts are the tasks' test texts (data/<task>/test.parquet), the tasks mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402


def texts_of(root: Path, tasks: list[str], n: int) -> pd.DataFrame:
    frames = []
    for t in tasks:
        path = root / "data" / t / "test.parquet"
        if path.is_file():
            frames.append(pd.read_parquet(path, columns=["text"]).assign(task=t))
    if not frames:
        raise SystemExit(f"{root}/data/<task>/test.parquet: none found for tasks {tasks}")
    # round robin over the tasks, repeated up to n rows
    rows, iters = [], [f.itertuples(index=False) for f in frames]
    while len(rows) < n:
        for it in list(iters):
            row = next(it, None)
            if row is None:
                iters.remove(it)
            else:
                rows.append({"text": row.text, "task": row.task})
        if not iters:
            iters = [f.itertuples(index=False) for f in frames]
    return pd.DataFrame(rows[:n])


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the workspace (its mlflow.db and data/)")
    parser.add_argument("--alias", default="champion", help="alias or version number")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for the server to answer /ping")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    from tasks.runtime.env import apply_defaults

    root = Path(args.root).resolve()
    apply_defaults(root)
    from tasks.registry.registry import resolve_version
    from tasks.registry.serving import (
        download_version,
        free_port,
        invocation_body,
        load_registered,
        registry_client,
        serve_command,
        serve_limits,
        stop_server,
        wait_until_serving,
    )
    from tasks.runtime.params import load_params

    params = load_params(root / "params.yaml")
    name = params.tracking.registered_model
    mv = resolve_version(registry_client(root), name, args.alias)
    tags = mv.tags
    tasks = tags.get("crucible.tasks", "").split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_registered(root, str(mv.version), name, dst=Path(tmp))
        pyfunc_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
    single, batch = texts_of(root, tasks, 1), texts_of(root, tasks, args.batch)
    local = {
        "single": median_seconds(lambda: model.predict(single), args.repeats),
        "batch": median_seconds(lambda: model.predict(batch), args.repeats),
    }

    port = args.port or free_port()
    served_copy = tempfile.TemporaryDirectory(prefix="serve-latency-")
    model_dir = download_version(root, name, str(mv.version), Path(served_copy.name))
    cmd, env = serve_command(model_dir, "127.0.0.1", port, serve_limits(params))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            startup = wait_until_serving(url, proc, args.wait, Path(log.name))
        except RuntimeError as exc:
            raise SystemExit(f"{exc}\n(its log: {log.name})") from None

        def request(frame: pd.DataFrame):
            body = json.dumps(invocation_body(list(zip(frame["text"], frame["task"])))).encode()
            req = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                out = json.loads(resp.read())
            assert len(out["predictions"]) == len(frame)

        http = {
            "single": median_seconds(lambda: request(single), args.repeats),
            "batch": median_seconds(lambda: request(batch), args.repeats),
        }
    finally:
        stop_server(proc)
        served_copy.cleanup()

    served, flt = int(tags.get("crucible.size.served_bytes", 0)), int(tags.get("crucible.size.float_bytes", 0))
    accuracy = {k.split(".")[-1]: float(v) for k, v in tags.items() if k.startswith("crucible.metric.accuracy.")}
    result = {
        "model": f"models:/{name}/{mv.version}",
        "aliases": sorted(mv.aliases),
        "kind": tags.get("crucible.model_kind"),
        "size_mb": {"served": served / 2**20, "float": flt / 2**20, "pyfunc": pyfunc_bytes / 2**20},
        "size_ratio": served / flt if flt else None,
        "accuracy": accuracy,
        "mean_accuracy": float(tags.get("crucible.metric.mean_accuracy", "nan")),
        "latency_ms": {
            "http": {k: 1000 * v for k, v in http.items()},
            "in_process": {k: 1000 * v for k, v in local.items()},
        },
        "ratio_http_to_in_process": {k: http[k] / local[k] for k in http},
        "server_startup_s": startup,
        "repeats": args.repeats,
        "batch": args.batch,
        "threads": _threads(),
    }
    print(f"{result['model']} ({', '.join(result['aliases']) or 'no alias'}), {result['kind']}")
    print(
        f"size on disk: served {result['size_mb']['served']:.1f} MB vs float {result['size_mb']['float']:.1f} MB"
        f" (x{result['size_ratio']:.3f}); the logged pyfunc folder {result['size_mb']['pyfunc']:.1f} MB"
    )
    print(
        "test accuracy: "
        + ", ".join(f"{t} {a:.4f}" for t, a in accuracy.items())
        + f"; mean {result['mean_accuracy']:.4f}"
    )
    print(f"latency, median of {args.repeats} ({result['threads']} torch threads; server up in {startup:.1f} s):")
    print(f"  {'':<14}{'HTTP':>10}{'in process':>12}{'ratio':>8}")
    for k, label in (("single", "1 text"), ("batch", f"{args.batch} texts")):
        print(f"  {label:<14}{1000 * http[k]:>8.1f}ms{1000 * local[k]:>10.1f}ms{http[k] / local[k]:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
