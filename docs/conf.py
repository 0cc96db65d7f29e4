"""Sphinx configuration of tandem's documentation site.

Build it with ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html`` (the
``docs`` extra installs what it needs); ``tests/test_docs.py`` runs the same build, with
warnings as errors, as part of the test command.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The API pages import tandem from the checkout, installed or not.
sys.path.insert(0, str(ROOT / "src"))

import tandem  # noqa: E402

project = "tandem"
author = "the tandem authors"
copyright = "the tandem authors"
release = tandem.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# The pages are MyST Markdown; the only reStructuredText is what autodoc reads from docstrings.
source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/compare/, docs/gpu/ and docs/render_trace.py are not pages: Sphinx only reads *.md.
exclude_patterns = ["_build"]

# Headings down to ### get anchors, so that pages link to each other's sections
# (`[text](../guides/ddp.md#how-it-works)`); a link to a missing anchor is a warning.
myst_heading_anchors = 3
# Code blocks with no language (plain text, terminal output) are not highlighted as Python.
highlight_language = "text"

# No intersphinx: torch's and Python's inventories (objects.inv) would be downloaded at build
# time, and the build must work without a network (an inventory of torch's pages made by hand
# here could not be checked against them). Nitpicky mode (-n) stays on all the same: every
# cross-reference must resolve, and `resolve_missing` below decides what a reference to an object
# without a page here becomes.
nitpicky = True

# API pages: members in source order, type hints in the description (the signatures stay
# readable), Google-style "Args:"/"Returns:" sections read by napoleon.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"tandem {release}"
html_theme_options = {
    "description": "Data-parallel training for PyTorch",
    "fixed_sidebar": True,
    "page_width": "1240px",
    "sidebar_width": "280px",
}
html_sidebars = {
    "**": ["about.html", "searchfield.html", "navigation.html", "localtoc.html", "relations.html"]
}
html_static_path = ["_static"]


# --- references that name no documented object -----------------------------------------------
#
# The docstrings name torch's and the standard library's objects, and tandem's internal modules,
# which have no page here. Such a reference is shown as plain code when the object exists (it is
# imported to check), so that a stale or misspelt name still fails the build; an unqualified
# name that matches exactly one documented object (``CheckpointError``) links to it.


def _exists(dotted: str) -> bool:
    """Whether ``dotted`` names an importable module or an attribute path inside one."""
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", dotted):
        return False
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    import builtins

    return hasattr(builtins, dotted)


def _candidates(target: str, module: str | None, cls: str | None) -> list[str]:
    names = [target]
    if module:
        if cls:
            names.append(f"{module}.{cls}.{target}")
        names.append(f"{module}.{target}")
    # A type hint autodoc could not evaluate (a name imported under TYPE_CHECKING, an alias)
    # keeps its bare name, written in the module that defines the documented object.
    names += [f"{m}.{target}" for m in sorted(sys.modules) if m.startswith("tandem.")]
    return names


def resolve_missing(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    objects = env.get_domain("py").objects
    matches = [
        name
        for name, entry in objects.items()
        if (name == target or name.endswith("." + target)) and not entry.aliased
    ]
    if len(matches) == 1:
        from sphinx.util.nodes import make_refnode

        entry = objects[matches[0]]
        return make_refnode(
            app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, matches[0]
        )
    if any(_exists(name) for name in _candidates(target, module, cls)):
        return contnode
    return None


# --- napoleon and prose --------------------------------------------------------------------------
#
# napoleon reads a property's docstring "int: the count" as a type and a description. tandem's
# docstrings are prose, and "Where the join runs: the module's device" is no type: only a
# prefix that looks like a type annotation is taken as one.

from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

_TYPE_LIKE = re.compile(r"[\w.]+(\[.*\])?(\s*\|\s*[\w.]+(\[.*\])?)*")
_inline_attribute = GoogleDocstring._consume_inline_attribute


def _consume_inline_attribute(self: Any) -> tuple[str, list[str]]:
    before, colon, _ = self._partition_field_on_colon(self._lines.get(0))
    if colon and not _TYPE_LIKE.fullmatch(before.strip()):
        lines = self._dedent(self._consume_to_end())
        return "", self.__class__(lines, self._config).lines()
    return _inline_attribute(self)


GoogleDocstring._consume_inline_attribute = _consume_inline_attribute  # type: ignore[method-assign]


def setup(app: Any) -> None:
    app.connect("missing-reference", resolve_missing)
