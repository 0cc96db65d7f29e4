"""Sphinx configuration of tandem's documentation site.

Build it with ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html`` (the
``docs`` extra installs what it needs); ``tests/test_docs.py`` runs the same build, with
warnings as errors, as part of the test command.
"""

from __future__ import annotations

import importlib
import inspect
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
    "sphinx.ext.intersphinx",
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

# Links to torch's and Python's documentation. The build has no network, so intersphinx reads
# inventories committed in docs/_inventories/ instead of downloading each site's objects.inv:
# - torch.inv is generated from the installed torch by docs/torch_inventory.py, with the addresses
#   docs.pytorch.org gives each object (checked against a real objects.inv of torch's, see
#   "The documentation site" in docs/concepts/architecture.md); regenerate it after a torch
#   upgrade, or when a docstring names a torch object it lacks (the build then fails), with
#   `python docs/torch_inventory.py`.
# - python.inv is CPython 3.11's own objects.inv, as Debian's python3.11-doc package ships it
#   (/usr/share/doc/python3.11/html/objects.inv).
intersphinx_mapping = {
    "torch": ("https://docs.pytorch.org/docs/stable/", "_inventories/torch.inv"),
    "python": ("https://docs.python.org/3/", "_inventories/python.inv"),
}

# Nitpicky mode (-n): every cross-reference must resolve; `resolve_missing` below decides what a
# reference to an object without a page here or in an inventory becomes.
nitpicky = True
# torch objects that torch's documentation does not document (no page, no anchor to link to):
# shown as plain code. Anything else of torch's must resolve through torch.inv.
nitpick_ignore = [
    ("py:class", "torch.distributed.ProcessGroup"),
    ("py:class", "torch.distributed.distributed_c10d.ProcessGroup"),
]

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
# which have no page here, often as written in the source (``nn.Module``, ``dist.ProcessGroup``,
# a type hint's ``torch.nn.modules.module.Module``). A reference intersphinx could not resolve
# as written comes here:
# - an unqualified name that matches exactly one documented object (``CheckpointError``) links
#   to it;
# - otherwise the name is looked up (imported) where it was written; an object found there links
#   to torch's or Python's documentation under any name it is documented by (``nn.Module`` is
#   ``torch.nn.Module``);
# - a torch object that no inventory holds fails the build, unless nitpick_ignore says torch does
#   not document it; tandem's internal objects, and standard-library objects without an entry,
#   are shown as plain code;
# - a name that imports nothing (a stale or misspelt one) fails the build.


def _lookup(dotted: str) -> tuple[bool, Any]:
    """Whether ``dotted`` names an importable module or an attribute path inside one, and what."""
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", dotted):
        return False, None
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
            return False, None
        return True, value
    import builtins

    return hasattr(builtins, dotted), getattr(builtins, dotted, None)


def _names_of(obj: Any) -> list[str]:
    """The names an object is documented by elsewhere: a module's, or where it is defined."""
    if inspect.ismodule(obj):
        return [obj.__name__]
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        found, value = _lookup(f"{module}.{qualname}")
        if found and value is obj:
            return [f"{module}.{qualname}"]
    return []


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


def _from_torch(obj: Any, names: list[str]) -> bool:
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    names = [*names, module if isinstance(module, str) else ""]
    return any(name == "torch" or name.startswith("torch.") for name in names)


def resolve_missing(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    from sphinx.ext import intersphinx

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
    ignored = {name for kind, name in app.config.nitpick_ignore if kind.startswith("py:")}
    for candidate in _candidates(target, module, cls):
        found, obj = _lookup(candidate)
        if not found:
            continue
        names = list(dict.fromkeys([candidate, *_names_of(obj)]))
        for name in names:  # as written too: intersphinx tried it for the role's types only
            elsewhere = node.deepcopy()
            elsewhere["reftarget"], elsewhere["reftype"] = name, "obj"
            link = intersphinx.missing_reference(app, env, elsewhere, contnode)
            if link is not None:
                return link
        if ignored.intersection(names) or not _from_torch(obj, names):
            return contnode
        return None  # a documented torch object that torch.inv lacks: regenerate it
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
