"""`dvc plots show` draws offline (tasks/runtime/dvc_plots.py): its page has vega, vega-lite and
vega-embed inlined from an installed package and no script fetched from the network; a scratch
workspace gets the same page template and setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tasks.runtime.dvc_plots import TEMPLATE, template_html, write_template

BIN = Path(sys.executable).parent
REMOTE_SCRIPT = re.compile(r"""<script[^>]*\bsrc\s*=\s*["']?(https?:)?//""", re.IGNORECASE)


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=root, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_dvc_plots_show_writes_a_page_that_fetches_nothing(tmp_path):
    dvc(tmp_path, "init", "--no-scm", "-q")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "curve.csv").write_text("step,acc\n0,0.5\n1,0.7\n2,0.8\n")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": [{"metrics/curve.csv": {"x": "step", "y": "acc"}}]}))
    # DVC's own page: the scripts come from a CDN, so offline the chart stays blank
    dvc(tmp_path, "plots", "show", "-o", "online")
    assert REMOTE_SCRIPT.search((tmp_path / "online" / "index.html").read_text())

    path = write_template(tmp_path)
    assert path == tmp_path / ".dvc" / TEMPLATE
    assert "html_template = plots/offline.html" in (tmp_path / ".dvc" / "config.local").read_text()
    dvc(tmp_path, "plots", "show", "-o", "offline")
    page = (tmp_path / "offline" / "index.html").read_text()
    assert not REMOTE_SCRIPT.search(page), "a script is still fetched"
    assert "cdn.jsdelivr.net" not in page
    # the three libraries are in the page, in load order, and the chart calls them
    versions = [page.find('version="5.33.0"'), page.find('"5.23.0"'), page.find("vegaEmbed=")]
    assert -1 not in versions and versions == sorted(versions), versions
    assert "vegaEmbed('#" in page and '"acc"' in page
    assert page.count("</script>") == page.count("<script")  # no script cut short by its own text
    write_template(tmp_path)  # again: nothing changes, the setting is not written twice
    assert (tmp_path / ".dvc" / "config.local").read_text().count("html_template") == 1


def test_a_scratch_workspace_gets_the_template_and_the_setting(tmp_path, project_root):
    from tasks.runtime.params import render_params
    from tasks.runtime.workspace import make_workspace

    source = tmp_path / "src"
    (source / ".dvc" / "plots").mkdir(parents=True)
    (source / ".dvc" / TEMPLATE).write_text(template_html())
    (source / "params.yaml").write_text(yaml.safe_dump(render_params(project_root / "params.yaml", "demo")))
    dest = make_workspace(source, tmp_path / "ws", "tiny")
    assert (dest / ".dvc" / TEMPLATE).read_text() == template_html()
    assert "html_template = plots/offline.html" in (dest / ".dvc" / "config.local").read_text()
