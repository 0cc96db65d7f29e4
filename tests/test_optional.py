"""Optional packages are needed only by the features that use them, and say how to install them.

Proves: with lmdb, tqdm and matplotlib missing (``sys.modules[name] = None`` makes their import
fail, as an uninstalled package does), ``import tandem`` and its command line still work; using
LMDB files, or a conversion's progress bar, raises ImportError naming the extra to install
(``pip install "tandem[lmdb]"``), with the original error as its cause; ``tandem lmdb`` prints
that as one line with status 2; a conversion without a progress bar needs no tqdm.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem._optional import require
from tandem.cli import main
from tandem.data.lmdb import LMDBDataset, convert_to_lmdb

SMALL = [(i, f"sample {i}") for i in range(3)]


def test_require_returns_the_module():
    assert require("json", extra="none") is sys.modules["json"]


@pytest.mark.parametrize(
    ("module", "extra", "top"),
    [("lmdb", "lmdb", "lmdb"), ("tqdm", "progress", "tqdm"), ("matplotlib", "plots", "matplotlib")],
)
def test_missing_module_names_the_extra(monkeypatch, module, extra, top):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError) as info:
        require(module, extra=extra)
    assert str(info.value) == f'{top} is not installed: pip install "tandem[{extra}]"'
    assert info.value.name == top
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_submodule_names_its_distribution(monkeypatch):
    # Submodules another test imported stay cached: the package is gone only without them too.
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'^matplotlib is not installed: .*"tandem\[plots\]"$'):
        require("matplotlib.figure", extra="plots")


def test_lmdb_dataset_without_lmdb(monkeypatch, tmp_path):
    path = convert_to_lmdb(SMALL, tmp_path / "small.lmdb", progress=False)
    monkeypatch.setitem(sys.modules, "lmdb", None)
    with pytest.raises(ImportError, match=r'lmdb is not installed: pip install "tandem\[lmdb\]"'):
        LMDBDataset(path)
    with pytest.raises(ImportError, match=r'"tandem\[lmdb\]"'):
        convert_to_lmdb(SMALL, tmp_path / "other.lmdb", progress=False)


def test_progress_bar_without_tqdm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(
        ImportError, match=r'tqdm is not installed: pip install "tandem\[progress\]"'
    ):
        convert_to_lmdb(SMALL, tmp_path / "bar.lmdb", progress=True)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    # No bar asked for, no tqdm needed.
    path = convert_to_lmdb(SMALL, tmp_path / "quiet.lmdb", progress=False)
    assert [LMDBDataset(path)[i] for i in range(3)] == SMALL


def test_lmdb_command_without_lmdb_is_one_line(monkeypatch, tmp_path, capsys):
    path = convert_to_lmdb(SMALL, tmp_path / "small.lmdb", progress=False)
    monkeypatch.setitem(sys.modules, "lmdb", None)
    assert main(["lmdb", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == 'tandem lmdb info: error: lmdb is not installed: pip install "tandem[lmdb]"\n'


def test_import_tandem_needs_none_of_them():
    code = (
        "import sys\n"
        "sys.modules.update(lmdb=None, tqdm=None, matplotlib=None)\n"
        "import tandem, tandem.data, tandem.data.lmdb, tandem.cli, tandem.launch.supervisor\n"
        "tandem.cli.main(['slurm', '--nodes', '1', '--gpus-per-node', '1', '--time', '10',"
        " '--', 'train.py'])\n"
        "print(tandem.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(__import__("tandem").__version__)
