"""The documentation site builds without a warning, and the Markdown beside it links to real files.

The build is Sphinx's own (``-W --keep-going -n``): a warning fails it, and nitpicky mode (with
``docs/conf.py``'s rule for names that have no page) makes every cross-reference resolve, torch's
and Python's through the inventories committed in ``docs/_inventories/``. MyST
checks the links between the pages and their ``#anchors``. The README and ``tests/README.md``
are not pages of the site: their relative links are checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from myst_parser.slugs import github_slugify

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUTSIDE_THE_SITE = [ROOT / "README.md", ROOT / "tests" / "README.md"]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


@pytest.mark.launch
def test_docs_build_without_warnings(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
        "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, (
        f"the docs build failed ({' '.join(command)}):\n{done.stdout}\n{done.stderr}"
    )
    for page in ["index", "guides/ddp", "concepts/architecture", "reference/engines", "gpu"]:
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    # intersphinx, from the inventories committed in docs/_inventories/: a type hint naming
    # torch's Module links to its page on docs.pytorch.org, and a pathlib.Path to Python's docs.
    engines = (tmp_path / "html" / "reference" / "engines.html").read_text()
    module_page = "https://docs.pytorch.org/docs/stable/generated/torch.nn.Module.html"
    assert f'href="{module_page}#torch.nn.Module"' in engines
    checkpoint = (tmp_path / "html" / "reference" / "checkpoint.html").read_text()
    assert 'href="https://docs.python.org/3/library/pathlib.html#pathlib.Path"' in checkpoint


def test_torch_inventory_is_what_the_script_writes() -> None:
    """docs/_inventories/torch.inv is rewritten whenever docs/torch_inventory.py's lists change."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("torch_inventory", DOCS / "torch_inventory.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    committed = script.OUT.read_bytes()
    made_for = committed.split(b"\n")[2].decode().removeprefix("# Version: ")
    installed = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if made_for != installed:
        pytest.skip(f"torch.inv was made from torch {made_for}; torch {installed} is installed")
    assert committed == script.render(script.entries()), (
        "docs/_inventories/torch.inv is stale: run `python docs/torch_inventory.py` and commit it"
    )


def _links(text: str) -> list[tuple[int, str]]:
    """Every Markdown link target outside fenced code blocks, with its line number."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            found += [(number, target) for target in LINK.findall(line)]
    return found


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    headings = [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*$", text, re.M)]
    return {github_slugify(heading) for heading in headings}


@pytest.mark.parametrize("markdown", OUTSIDE_THE_SITE, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_outside_the_site_resolve(markdown: Path) -> None:
    broken = []
    for number, target in _links(markdown.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (markdown.parent / path).resolve() if path else markdown
        if not where.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"line {number}: {target} (no heading with that anchor)")
    assert not broken, f"{markdown.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_link_check_finds_links() -> None:
    text = "[a](docs/x.md) ![b](docs/y.png)\n```\n[not](code.md)\n```\n[c](https://x.org)\n"
    assert _links(text) == [(1, "docs/x.md"), (1, "docs/y.png"), (5, "https://x.org")]
