"""Pseudo-label quality on every demo task: the design-corrected estimates against the truth, their
interval coverage over repeated audits, and what the labels are worth to a probe trained on them.

    python benchmarks/pseudolabel_quality.py --profile tiny --workdir /tmp/crucible-plq [--draws 200]
    python benchmarks/pseudolabel_quality.py --profile tiny --n-reference 100 --n-pool 400 --n-test 200 --budget 60

Runs ingest, embed, curate and pseudolabel per task in a scratch workspace (tasks.runtime.workspace; stages
whose outputs exist are not rerun unless --force). Then, per task:
- est / true: the stage's accuracy estimate (clean pool, and on the selection) beside the truth;
- coverage: the pool, the teacher and the selection held fixed, the Poisson audit is redrawn
  `--draws` times from the ingest's own design (pi recomputed exactly as ingest did, checked against
  the stored audit's pi), and each draw's 95% interval is checked against the true value;
- probe test accuracy of a logistic regression (same C as the teacher) trained on the reference
  only; on the stage's labeled.parquet (reference + audited members + selected pseudo-labels, with
  their weights); on the reference + every pooled item with its pseudo-label, weight 1 (ignoring
  contamination); and, for scale, on the reference + the clean pool's true labels (oracle).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crucible import pseudolabel as pl  # noqa: E402
from crucible.contamination import draw_poisson_sample, poisson_inclusion_probabilities  # noqa: E402
from tasks.data.embeddings import load_embeddings  # noqa: E402
from tasks.runtime.declaration import expand  # noqa: E402
from tasks.runtime.params import load_params  # noqa: E402
from tasks.runtime.workspace import make_workspace  # noqa: E402
from tasks.stages import execute, spec  # noqa: E402

STAGES = ("ingest", "embed", "curate", "pseudolabel")


def prepare(workdir: Path, profile: str, overrides: dict, force: bool) -> Path:
    root = make_workspace(ROOT, workdir, profile, overrides or None)
    params = load_params(root / "params.yaml")
    for task in params.pipeline.tasks:
        for stage in STAGES:
            outs = [expand(p, task) for p in spec(stage).written()]
            if force or not all((root / p).exists() for p in outs) or stage == "pseudolabel":
                print(f"  {stage}@{task} ...", file=sys.stderr, flush=True)
                execute(stage, task, root)
    return root


def probe_accuracy(x, y, w, x_test, y_test, C: float) -> float:
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=C, max_iter=5000).fit(x, y, sample_weight=w)
    return float((model.predict(x_test) == y_test).mean())


def evaluate_task(root: Path, params, task: str, draws: int, seed: int) -> dict:
    cfg = params.pseudolabel
    base = root / "data" / task
    ref, pool, test = (pd.read_parquet(base / f"{t}.parquet") for t in ("reference", "pool", "test"))
    audit = pd.read_parquet(base / "audit.parquet").set_index("id")
    truth = pd.read_parquet(base / "truth.parquet").set_index("id").loc[pool["id"]]
    curated = pd.read_parquet(base / "curated.parquet")
    labeled = pd.read_parquet(base / "labeled.parquet")
    import json

    metrics = json.loads((root / "metrics" / task / "pseudolabel.json").read_text())
    emb = {
        k: v.double().numpy()
        for k, v in load_embeddings(root, task, {"reference": ref, "pool": pool, "test": test}).items()
    }
    # the stage's probe teacher, refitted identically (deterministic) on the same training rows, so the
    # pool's predictions are fixed
    from tasks.data.teachers import dev_mask, teacher_seed

    dev = dev_mask(ref, cfg.dev_fraction, params.pipeline.seed, task)
    teacher = pl.fit_teacher(
        emb["reference"], ref["label"].to_numpy(object), dev=dev, C=cfg.C, seed=teacher_seed(params.pipeline.seed, task)
    )
    pred = pl.predict(teacher, emb["pool"])
    selected = pl.select(pred, mode=cfg.selection, threshold=cfg.threshold, quota=cfg.quota, target=cfg.target_accuracy)
    member = truth["member"].to_numpy(np.float64)
    y_true = pl.label_indices(np.where(member == 1, truth["label"].to_numpy(object), None), teacher.classes)
    true = pl.true_quality(pred, teacher.classes, member, y_true, selected)

    # the ingest's Poisson design, recomputed; it must reproduce the stored audit's pi
    ing = params.ingest
    s_ing = pool["score"].to_numpy(np.float64) if "score" in pool else None
    unc = s_ing * (1 - s_ing) if ing.audit.design == "uncertainty" else None
    pi = poisson_inclusion_probabilities(len(pool), ing.audit.budget, unc, ing.audit.pi_floor)
    audited_now = pool["id"].isin(audit.index).to_numpy()
    np.testing.assert_allclose(pi[audited_now], audit.loc[pool["id"][audited_now], "pi"].to_numpy(), rtol=1e-9)

    scores = curated["score"].to_numpy(np.float64)
    rng = np.random.default_rng(seed)
    keys = ["accuracy", "selected_accuracy", *(f"prior_{c}" for c in teacher.classes)]
    hits = {k: 0 for k in keys}
    est_acc, failed = [], 0
    for _ in range(draws):
        i = draw_poisson_sample(pi, rng)
        try:
            q = pl.estimate_quality(
                pred,
                teacher.classes,
                scores,
                i,
                np.where(i, member, np.nan),
                np.where(i, y_true, -1),
                pi,
                selected,
                level=cfg.level,
            ).to_dict()
        except ValueError:  # a draw with a non-positive estimated denominator
            failed += 1
            continue
        est_acc.append(q["accuracy"])
        for k in keys:
            hits[k] += q[f"{k}_ci_low"] <= true[k] <= q[f"{k}_ci_high"]
    ok = draws - failed

    # probes on the test set
    y_ref = ref["label"].to_numpy(object)
    y_test = test["label"].to_numpy(object)
    x_of = dict(zip(ref["id"], emb["reference"])) | dict(zip(pool["id"], emb["pool"]))
    x_lab = np.stack([x_of[i] for i in labeled["id"]])
    classes = np.array(teacher.classes, dtype=object)
    clean = member == 1
    acc = {
        "ref_only": probe_accuracy(emb["reference"], y_ref, None, emb["test"], y_test, cfg.C),
        "weighted": probe_accuracy(
            x_lab, labeled["label"].to_numpy(object), labeled["weight"].to_numpy(), emb["test"], y_test, cfg.C
        ),
        "unweighted_pool": probe_accuracy(
            np.vstack([emb["reference"], emb["pool"]]),
            np.r_[y_ref, classes[pred.label]],
            None,
            emb["test"],
            y_test,
            cfg.C,
        ),
        "oracle_clean": probe_accuracy(
            np.vstack([emb["reference"], emb["pool"][clean]]),
            np.r_[y_ref, classes[y_true[clean]]],
            None,
            emb["test"],
            y_test,
            cfg.C,
        ),
    }
    return {
        "task": task,
        "n_pool": len(pool),
        "n_sel": int(selected.sum()),
        "eps": 1 - member.mean(),
        "T": teacher.temperature,
        "acc_est": metrics["accuracy"],
        "acc_ci": (metrics["accuracy_ci_low"], metrics["accuracy_ci_high"]),
        "acc_true": true["accuracy"],
        "sel_est": metrics["selected_accuracy"],
        "sel_true": true["selected_accuracy"],
        "naive": float(pred.confidence.mean()),
        "mean_est": float(np.mean(est_acc)) if est_acc else float("nan"),
        "cov_acc": hits["accuracy"] / max(ok, 1),
        "cov_sel": hits["selected_accuracy"] / max(ok, 1),
        "cov_prior": float(np.mean([hits[k] for k in keys[2:]])) / max(ok, 1),
        "draws": ok,
        **acc,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "crucible-pseudolabel-bench")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--force", action="store_true", help="rerun every stage")
    ap.add_argument("--n-reference", type=int)
    ap.add_argument("--n-pool", type=int)
    ap.add_argument("--n-test", type=int)
    ap.add_argument("--budget", type=int, help="expected audit size")
    args = ap.parse_args(argv)

    base = load_params(ROOT / "params.yaml", args.profile)
    sizes = {
        k: v for k, v in (("n_reference", args.n_reference), ("n_pool", args.n_pool), ("n_test", args.n_test)) if v
    }
    overrides: dict = {}
    if sizes:
        overrides["pipeline"] = {
            "tasks": {t: {**spec.model_dump(exclude_none=True), **sizes} for t, spec in base.pipeline.tasks.items()}
        }
    if args.budget:
        overrides["ingest"] = {"audit": {"budget": args.budget}}
    root = prepare(args.workdir, args.profile, overrides, args.force)
    params = load_params(root / "params.yaml")
    rows = [evaluate_task(root, params, t, args.draws, args.seed) for t in params.pipeline.tasks]

    print(
        f"pseudo-label quality, profile {args.profile}{' + ' + str(overrides) if overrides else ''}; "
        f"coverage of the {params.pseudolabel.level:.0%} interval over {args.draws} audit redraws"
    )
    head = (
        f"{'task':8s} {'n_pool':>6s} {'eps':>5s} {'T':>5s} {'n_sel':>5s} | {'acc est':>7s} {'[95% CI]':>15s} "
        f"{'true':>5s} {'naive':>5s} {'E[est]':>6s} | {'sel est':>7s} {'true':>5s} | {'cov acc':>7s} {'cov sel':>7s} "
        f"{'cov pri':>7s} | {'ref':>5s} {'+wtd':>5s} {'+pool':>5s} {'oracle':>6s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['task']:8s} {r['n_pool']:6d} {r['eps']:5.2f} {r['T']:5.2f} {r['n_sel']:5d} | {r['acc_est']:7.3f} "
            f"[{r['acc_ci'][0]:6.3f},{r['acc_ci'][1]:6.3f}] {r['acc_true']:5.3f} {r['naive']:5.3f} "
            f"{r['mean_est']:6.3f} | {r['sel_est']:7.3f} {r['sel_true']:5.3f} | {r['cov_acc']:7.2f} "
            f"{r['cov_sel']:7.2f} {r['cov_prior']:7.2f} | {r['ref_only']:5.3f} {r['weighted']:5.3f} "
            f"{r['unweighted_pool']:5.3f} {r['oracle_clean']:6.3f}"
        )
    print(
        "acc: pseudo-label accuracy on the clean pool; naive: mean confidence over the whole pool; E[est]: mean "
        "estimate over redraws;\ncov pri: mean coverage over the class-prior intervals; probe test accuracy: "
        "ref = reference only, +wtd = labeled.parquet with weights,\n+pool = reference + every pooled item's "
        "pseudo-label (weight 1), oracle = reference + the clean pool's true labels"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
