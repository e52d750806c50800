"""The report on synthetic evaluate results (3 tasks, 2 merge methods, every family): every variant
and interface on the page, nothing fetched from the network, every figure a PNG and inlined, the
same bytes twice, optional sections left out, strings escaped, the findings follow the numbers, and
a Chromium render when Chromium is installed."""

import base64
import html
import math
import re

import numpy as np
import pandas as pd
import pytest

from tasks.report.page import PNG_SIGNATURE, build_report, find_chromium, findings, fmt, screenshot

ORDER = ["bbc", "rotten", "tweets"]
INTERFACES = ["head", "probe", "kmeans"]
METHODS = ["gs3r", "ties"]
QUANT = ["mxfp4", "mxfp4_uniform", "mxfp4_load_aware"]
NAN = float("nan")


def make_results(seed: int = 0, main: str = "gs3r", order=ORDER, interfaces=INTERFACES, methods=METHODS) -> dict:
    """Results shaped like the evaluate stage's: the head forgets under merging, the probe does not,
    clustering a little."""
    rng = np.random.default_rng(seed)
    tasks, itfs = list(order), list(interfaces)
    metrics = [m for i in itfs for m in ([i] if i in ("head", "probe") else [f"{i}_nmi", f"{i}_ari"])]
    cells = []

    def add(variant, family, method, arrival, on, score):
        for t in on:
            for m in metrics:
                cells.append(
                    {
                        "variant": variant,
                        "family": family,
                        "method": method,
                        "arrival": arrival,
                        "task": t,
                        "metric": m,
                        "value": float(score(t, m)),
                    }
                )

    def interface(metric):
        return metric.rsplit("_", 1)[0] if metric.endswith(("_nmi", "_ari")) else metric

    add("base", "base", "base", -1, tasks, lambda t, m: 0.3 + 0.1 * rng.random())
    for j, t in enumerate(tasks):
        add(f"finetune:{t}", "finetune", "finetune", j, tasks, lambda u, m, t=t: 0.9 if u == t else 0.5)
    matrices, curves, summary = {}, [], []
    for k, method in enumerate([main, *methods[1:], "latest_finetune"]):
        forget = {i: {"head": 0.12 + 0.05 * k, "probe": 0.005}.get(i, 0.04) for i in itfs}
        R = {i: [[NAN] * len(tasks) for _ in tasks] for i in itfs}
        for j in range(len(tasks)):
            for i in range(j + 1):
                for itf in itfs:
                    R[itf][j][i] = 0.85 - forget[itf] * (j - i) - 0.01 * k
            if method != "latest_finetune":
                add(
                    f"{method}@{j}",
                    "merge",
                    method,
                    j,
                    tasks[: j + 1],
                    lambda t, m, j=j, R=R: 0.5 if m.endswith("_ari") else R[interface(m)][j][tasks.index(t)],
                )
        matrices[method] = R
        family = "finetune" if method == "latest_finetune" else "merge"
        for itf in itfs:
            M = np.array(R[itf])
            bwt = float(np.mean([M[-1, i] - M[i, i] for i in range(len(tasks) - 1)]))
            summary.append(
                {"method": method, "family": family, "interface": itf, "acc": float(M[-1].mean()), "bwt": bwt}
            )
            curves += [
                {"method": method, "interface": itf, "arrival": j, "acc": float(np.nanmean(M[j, : j + 1]))}
                for j in range(len(tasks))
            ]
    for q in QUANT:
        add(f"quantize:{q}", "quantize", q, -1, tasks, lambda t, m: 0.6)
    for itf in itfs:
        summary.append({"method": "base", "family": "base", "interface": itf, "acc": 0.35, "bwt": 0.0})
        summary.append(
            {"method": f"{main}+mxfp4_load_aware", "family": "quantize", "interface": itf, "acc": 0.6, "bwt": NAN}
        )
    n = len(tasks)
    eps = 0.2 + 0.2 * rng.random(n)
    mmd = 0.01 + 0.02 * rng.random(n)
    curation = pd.DataFrame(
        {
            "task": tasks,
            "eps_true": eps,
            "eps_hat": eps + rng.normal(0, 0.03, n),
            "ccmmd": mmd,
            "ccmmd_ci_low": mmd - 0.01,
            "ccmmd_ci_high": mmd + 0.01,
            "naive": mmd + 0.06,
            "audit_only": [0.0001, *(mmd[1:] + 0.02)],
            "oracle": mmd + 0.002,
            "keep_precision": np.full(n, 0.9),
            "keep_recall": np.full(n, 0.8),
            "n_keep": np.full(n, 700),
            "n_pool": np.full(n, 1000),
        }
    )
    acc = 0.7 + 0.1 * rng.random(n)
    pseudolabel = pd.DataFrame(
        {
            "task": tasks,
            "accuracy": acc,
            "accuracy_ci_low": acc - 0.05,
            "accuracy_ci_high": acc + 0.05,
            "accuracy_true": acc + rng.normal(0, 0.02, n),
            "naive_accuracy": acc + 0.1,
            "n_selected": np.full(n, 700),
        }
    )
    finetune = pd.DataFrame(
        {
            "task": tasks,
            "test_accuracy": acc + 0.1,
            "dev_accuracy": [*(acc[:-1] + 0.1), NAN],
            "steps": np.arange(n) * 10 + 100,
            "n_train": 100 + np.arange(n),
        }
    )
    variants = ["float", *QUANT]
    quantize = {
        "accuracy": {v: {t: 0.8 - 0.05 * k for t in tasks} for k, v in enumerate(variants)},
        "mean_accuracy": {v: 0.8 - 0.05 * k for k, v in enumerate(variants)},
        "model_mb": {"float": 86.6, "quantized": 14.2},
        "bits_per_weight": 4.25,
        "bits_per_weight_all_in": 4.6,
        "recovered_share": {"uniform": 0.3, "load_aware": None},
        "accuracy_lost_by_mxfp4": 0.05,
    }
    return {
        "order": tasks,
        "interfaces": itfs,
        "main": main,
        "cells": pd.DataFrame(cells),
        "summary": pd.DataFrame(summary),
        "curves": pd.DataFrame(curves),
        "matrices": matrices,
        "curation": curation,
        "pseudolabel": pseudolabel,
        "finetune": finetune,
        "quantize": quantize,
        "moe": {
            "enabled": True,
            "source": "tiny.gguf",
            "n_experts": 8,
            "top_k": 2,
            "perplexity": {"dense": 20.5, "float": 22.0},
            "variants": {
                v: {
                    "perplexity": 22.0 + k,
                    "consistency_mean": {"set": 1 - 0.1 * k, "top1": 1 - 0.05 * k},
                    "drift_last": 0.01 * k,
                    "bits_per_weight": 32 if k == 0 else 4.6,
                    "bytes": {"total": 5e8 / (1 + k)},
                }
                for k, v in enumerate(("float", "mxfp4", "uniform", "load_aware", "qat"))
            },
            "ranks": {"budget": 64},
            "qat": {"steps": 10, "loss": "kl"},
        },
        "figures": {"quantize": PNG_SIGNATURE + b"fake-quantize-figure"},
        "meta": {
            "git_commit": "abc123",
            "params": {"evaluate": {"probe": {"C": 1.0}, "clustering": itfs[2:]}},
            "n_test": {t: 200 for t in tasks},
            "n_probe": {t: 150 for t in tasks},
        },
    }


@pytest.fixture(scope="module")
def report() -> dict:
    return build_report(make_results())


def _page(files) -> str:
    return files["index.html"].decode("utf-8")


def test_every_variant_and_interface_on_the_page(report):
    page = _page(report)
    results = make_results()
    for variant in results["cells"]["variant"].unique():
        assert f"<td>{html.escape(variant)}</td>" in page, variant
    for method in results["summary"]["method"].unique():
        assert f"<td>{html.escape(method)}</td>" in page, method
    for itf in INTERFACES:
        assert itf in page
    for title in ("Mixture of experts", "Curation", "Pseudo-labels", "Fine-tunes", "Quantization", "abc123"):
        assert title in page
    for variant in ("dense", "mxfp4", "uniform", "load_aware", "qat"):  # the MoE table, one row per variant
        assert f"<td>{variant}</td>" in page, variant
    assert "routing consistency (set)" in page and "same total adapter rank (64)" in page
    assert 'class="main"' in page  # the deployed method highlighted


def test_nothing_from_the_network(report):
    page = _page(report)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert "<link" not in page.lower() and "@import" not in page and "url(" not in page
    for src in re.findall(r'\bsrc="([^"]*)"', page):
        assert src.startswith("data:image/png;base64,"), src[:40]
    for href in re.findall(r'\bhref="([^"]*)"', page):
        assert href.startswith("#"), href


def test_figures_are_pngs_and_inlined(report):
    names = {k for k in report if k != "index.html"}
    assert names == {f"figures/{n}.png" for n in ("interfaces", "curves", "matrices", "ccmmd", "pseudolabel")}
    inlined = {base64.b64decode(s) for s in re.findall(r'src="data:image/png;base64,([^"]+)"', _page(report))}
    for name in names:
        assert report[name].startswith(PNG_SIGNATURE) and len(report[name]) > 5000, name
        assert report[name] in inlined, name
        assert b"tIME" not in report[name] and b"Software" not in report[name]  # no date, no version
    assert PNG_SIGNATURE + b"fake-quantize-figure" in inlined  # the stage's own figure


def test_same_input_same_bytes(report):
    again = build_report(make_results())
    assert again.keys() == report.keys()
    for name in report:
        assert again[name] == report[name], name


def test_optional_sections_omitted():
    results = make_results()
    for key in ("moe", "quantize", "curation", "pseudolabel", "finetune", "figures", "matrices", "curves", "meta"):
        results[key] = None
    results["cells"] = results["cells"].iloc[:0]
    files = build_report(results)
    page = _page(files)
    for gone in (
        "Mixture of experts",
        "Curation",
        "Pseudo-labels",
        "Fine-tunes",
        "Quantization",
        "Accuracy matrices",
        "Every variant",
    ):
        assert gone not in page, gone
    assert set(files) == {"index.html", "figures/interfaces.png"}
    assert "Continual merging: metrics per interface" in page and "Value:" not in page  # no value block given


def test_strings_escaped():
    results = make_results(main="<b>gs3r</b>")
    results["meta"]["git_commit"] = '"><script>alert(1)</script>'
    results["moe"] = {"enabled": True, "source": "<i>k</i> a & b"}
    page = _page(build_report(results))
    assert "<b>" not in page and "<script" not in page and "<i>" not in page
    assert "&lt;b&gt;gs3r&lt;/b&gt;" in page and "&lt;script&gt;" in page and "a &amp; b" in page


def test_script_in_a_task_name_or_a_finding_is_escaped():
    """The templates escape every string from the results: a task named `<script>...` (in the order,
    every table and the cards) and a main method named so (in the findings' sentences, the headline
    table, the title)."""
    task, method = "<script>alert('task')</script>", '<script>alert("m")</script>'
    results = make_results(main=method, order=["bbc", task, "tweets"])
    lines = findings(results["summary"], INTERFACES, method)
    assert any(method in line for line in lines)  # the finding names the method: plain text, unescaped
    page = _page(build_report(results))
    assert "<script" not in page.lower()
    assert page.count("&lt;script&gt;alert(&#39;task&#39;)&lt;/script&gt;") >= 5  # cards, tables, figures' tasks
    findings_html = page.split('<ul class="findings">')[1].split("</ul>")[0]
    assert findings_html.count("&lt;script&gt;alert(&#34;m&#34;)&lt;/script&gt;") == len(lines)
    assert "<title>crucible report: &lt;script&gt;" in page


def test_templates_ship_with_the_package_and_the_workspace(tmp_path, project_root):
    """The page's templates are package data (pyproject.toml) and the scratch workspace's copy of
    tasks/ holds them, so `crucible run --profile tiny` renders the same page."""
    import fnmatch
    import tomllib

    from tasks.report.page import TEMPLATES
    from tasks.runtime.workspace import make_workspace

    names = sorted(p.name for p in TEMPLATES.iterdir())
    assert "page.html.j2" in names and all(n.endswith(".j2") for n in names)
    patterns = tomllib.loads((project_root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(any(fnmatch.fnmatch(f"templates/{n}", pat) for pat in patterns["tasks.report"]) for n in names)
    ws = make_workspace(project_root, tmp_path / "ws")
    copied = ws / "tasks" / "report" / "templates"
    assert {n: (copied / n).read_bytes() for n in names} == {n: (TEMPLATES / n).read_bytes() for n in names}


def test_findings_follow_the_numbers():
    """The synthetic head forgets (BWT about -0.12), the probe does not (-0.005): the text says so."""
    results = make_results()
    lines = findings(results["summary"], INTERFACES, "gs3r")
    head, probe, kmeans, verdict = lines
    assert "task head" in head and "forgetting shows" in head
    assert "linear probe" in probe and "no forgetting" in probe
    assert "kmeans" in kmeans and "forgetting shows" in kmeans
    assert verdict.startswith("The interfaces disagree") and "no forgetting through probe" in verdict
    # flip the probe into forgetting: now every interface agrees
    s = results["summary"].copy()
    s.loc[s["interface"] == "probe", "bwt"] = -0.1
    assert findings(s, INTERFACES, "gs3r")[-1].startswith("The interfaces agree")


def test_format_and_bad_input():
    assert fmt(NAN) == "\u2013" and fmt(None) == "\u2013" and fmt(0.12345) == "0.123" and fmt(np.int64(7)) == "7"
    assert fmt(1e-5) == "1.00e-05" and fmt("<x>") == "&lt;x&gt;" and not math.isnan(float(fmt(0.5)))
    results = make_results()
    results["curation"] = results["curation"].drop(columns=["oracle"])
    with pytest.raises(ValueError, match=r"results\['curation'\].*oracle"):
        build_report(results)
    results = make_results()
    results["figures"] = {"merge": b"GIF89a"}
    with pytest.raises(ValueError, match="merge"):
        build_report(results)


def test_screenshot_without_chromium_returns_false_and_writes_nothing(tmp_path, report, monkeypatch):
    import tasks.report.page

    (tmp_path / "index.html").write_bytes(report["index.html"])
    monkeypatch.setattr(tasks.report.page, "find_chromium", lambda: None)
    assert screenshot(tmp_path / "index.html", tmp_path / "shot.png") is False
    assert not (tmp_path / "shot.png").exists()


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_chromium_screenshot(tmp_path, report):
    (tmp_path / "figures").mkdir()
    for name, data in report.items():
        (tmp_path / name).write_bytes(data)
    out = tmp_path / "shot.png"
    assert screenshot(tmp_path / "index.html", out, width=1200, height=1600)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 50_000


def test_missing_values_upstream_render_as_dashes():
    """Outside the demo the truth is unknown (oracle, eps_true, accuracy_true are NaN) and counts may be missing."""
    results = make_results()
    for col in ("oracle", "eps_true", "n_keep"):
        results["curation"][col] = NAN
    results["pseudolabel"]["accuracy_true"] = NAN
    results["quantize"]["recovered_share"] = {"uniform": None, "load_aware": None}
    files = build_report(results)
    assert files["figures/ccmmd.png"].startswith(PNG_SIGNATURE)
    curation = _page(files).split('id="curation"')[1].split("</table>")[0]
    assert curation.count('<td class="num">\u2013</td>') == 3 * len(ORDER)


def test_the_value_section_leads_with_the_deployed_model_against_the_probe():
    """The report's first section: the sentence with the task-mean difference to the probe and its
    interval, the accuracy of each model per task, and every paired difference with its interval."""
    results = make_results()
    order = list(results["order"])

    def cmp(d):
        return {"a": 0.8, "b": 0.8 - d, "diff": d, "ci_low": d - 0.02, "ci_high": d + 0.02, "n": 400, "p_value": 0.01}

    models = ("probe", "finetune", "merged", "float", "quantized")
    results["value"] = {
        "level": 0.95,
        "n_test": {t: 400 for t in order},
        "accuracy": {m: {**{t: 0.7 + 0.01 * k for t in order}, "mean": 0.7 + 0.01 * k} for k, m in enumerate(models)},
        "comparisons": {
            "quantized_vs_probe": {**{t: cmp(0.04) for t in order}, "mean": cmp(0.04)},
            "quantized_vs_finetune": {**{t: cmp(-0.01) for t in order}, "mean": cmp(-0.01)},
        },
        "normalised": {"quantized": {"value": 0.985, "ci_low": 0.97, "ci_high": 0.99}, "float": None},
    }
    results["register_model"] = "quantized"
    page = _page(build_report(results))
    assert page.index("Value: the deployed model") < page.index("Continual merging: metrics per interface")
    assert "+0.040 [+0.020, +0.060] (95% interval, paired bootstrap over 400 test rows)" in page
    assert "0.985 [0.970, 0.990] of the fine-tunes" in page
    assert "quantized − finetune" in page and "-0.010 [-0.030, +0.010]" in page
