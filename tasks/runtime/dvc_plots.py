"""Plots that draw offline: the page `dvc plots show` / `dvc plots diff` write, with vega inlined.

DVC's own page loads vega, vega-lite and vega-embed from a CDN, so without a network every chart
stays blank. `write_template(root)` writes an HTML template with the three scripts inlined to
.dvc/plots/offline.html and points DVC at it with `plots.html_template` in .dvc/config.local; the
page DVC fills from it (`{plot_divs}`, `{refresh_tag}`) fetches nothing. The template has no
`{scripts}` placeholder, where DVC would put its CDN script tags.

The scripts come from the PyPI package django-js-lib-vega-embed (vega 5.33, vega-lite 5.23,
vega-embed 6.29, MIT), which `make install` installs without its dependencies
(requirements/data-nodeps.txt): only its files are read. The template (about 0.8 MB) is made from
the installed package, not committed: .gitignore lists it, and the setting lives in DVC's local,
uncommitted config, so a checkout without the file keeps DVC's own page instead of failing.
`make install` writes it for the project (`python -m tasks.runtime.dvc_plots`), and every scratch
workspace (`crucible run --profile P`) gets the copy and the setting (tasks/runtime/workspace.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "js_lib_vega_embed"  # the import name of django-js-lib-vega-embed
DISTRIBUTION = "django-js-lib-vega-embed"
SCRIPTS = ("vega5.js", "vega-lite5.js", "vega-embed6.js")  # load order: vega-lite needs vega, vega-embed both
TEMPLATE = "plots/offline.html"  # relative to .dvc/, as DVC resolves plots.html_template

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- vega, vega-lite and vega-embed inlined (from the PyPI package %(dist)s): nothing is fetched -->
%(scripts)s
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def scripts_dir() -> Path:
    """The folder of the installed package's scripts; FileNotFoundError naming the install command."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) / "static" / PACKAGE if spec else None
    missing = [n for n in SCRIPTS if folder is None or not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the vega scripts for offline plots ({', '.join(missing)}) come from the package {DISTRIBUTION}, "
            f"which is not installed: `make install`, or pip install --no-deps -r requirements/data-nodeps.txt"
        )
    return folder


def template_html() -> str:
    """The template: DVC's page with the three scripts inlined instead of its CDN script tags."""
    folder = scripts_dir()
    # a script's text ends at the first `</script`: escaped (the JavaScript string is the same)
    texts = [(folder / name).read_text(encoding="utf-8").replace("</script", "<\\/script") for name in SCRIPTS]
    scripts = "\n".join(f"    <script>\n{text}\n    </script>" for text in texts)
    return PAGE.replace("%(dist)s", DISTRIBUTION).replace("%(scripts)s", scripts)


def use_template(dvc_dir: Path) -> None:
    """Point the DVC repository `dvc_dir` (a .dvc folder holding the template) at it, in its local config."""
    local = dvc_dir / "config.local"
    text = local.read_text() if local.is_file() else ""
    if f"html_template = {TEMPLATE}" in text:
        return
    if not text:
        local.write_text(f"[plots]\n    html_template = {TEMPLATE}\n")
        return
    dvc = Path(sys.executable).with_name("dvc")
    subprocess.run(
        [str(dvc) if dvc.exists() else "dvc", "config", "--local", "plots.html_template", TEMPLATE],
        cwd=dvc_dir.parent,
        check=True,
        capture_output=True,
    )


def write_template(root: Path | str) -> Path:
    """Write the template into `root`/.dvc/plots/ (when its text changed) and point DVC at it."""
    dvc_dir = Path(root) / ".dvc"
    if not dvc_dir.is_dir():
        raise FileNotFoundError(f"{dvc_dir}: not a DVC repository (no .dvc folder)")
    path = dvc_dir / TEMPLATE
    text = template_html()
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    use_template(dvc_dir)
    return path


if __name__ == "__main__":  # python -m tasks.runtime.dvc_plots [ROOT]: what `make install` runs
    try:
        written = write_template(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"error: offline plots: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"dvc plots: {written} (vega inlined; plots.html_template in .dvc/config.local)")
