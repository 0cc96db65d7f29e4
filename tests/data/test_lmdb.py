"""convert_to_lmdb and LMDBDataset give back every sample exactly, from any process.

Proves: a data set of tensors (many dtypes and shapes, NaN bits included), numpy arrays and
scalars, Python numbers, strings and bytes nested in dicts, tuples and lists round-trips bit for
bit; DataLoader workers (forked after the parent opened the file), two processes reading at once
and a pickled copy all read exactly what the parent reads; the map grows when it is full; a
conversion that raises or is killed leaves no file at the destination (and an older file there
intact); the `tandem lmdb` command converts and describes; mistakes give errors that carry the
values; importing the module does not import torch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tandem.cli.lmdb import register
from tandem.data.lmdb import LMDBDataset, convert_to_lmdb
from tandem.data.lmdb_codec import decode_sample, encode_sample
from tests.data.lmdb_data import N_SAMPLES, MixedDataset, assert_same, make_sample


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lmdb") / "mixed.lmdb"
    convert_to_lmdb(MixedDataset(), path, progress=False, commit_every=5)
    return path


def test_round_trip_every_sample_equal(mixed_path):
    ds = LMDBDataset(mixed_path)
    assert len(ds) == N_SAMPLES
    for i in range(N_SAMPLES):
        assert_same(make_sample(i), ds[i], f"sample {i}")
    assert_same(make_sample(N_SAMPLES - 1), ds[-1])
    assert_same(make_sample(3), ds[np.int64(3)])  # numpy indices from samplers


def test_decoded_arrays_are_writable_copies(mixed_path):
    sample = LMDBDataset(mixed_path)[1]
    sample["image"] += 1  # would fail (or warn) on a read-only view of the memory map
    sample["numpy"][0][...] = 0
    assert sample["tensors"][3].is_contiguous() and sample["tensors"][7].is_contiguous()


def test_transform_applies_to_decoded_sample(mixed_path):
    ds = LMDBDataset(mixed_path, transform=lambda s: s["label"])
    assert [ds[i] for i in range(N_SAMPLES)] == [i % 10 for i in range(N_SAMPLES)]


def _identity(sample):
    return sample


def test_dataloader_workers_read_what_the_parent_reads(mixed_path):
    ds = LMDBDataset(mixed_path)
    direct = [ds[i] for i in range(N_SAMPLES)]  # the parent's environment is open before fork
    # The workers send the samples re-encoded: the queue between worker and parent would
    # otherwise change them itself (it turns big-endian numpy arrays native).
    workers_ds = LMDBDataset(mixed_path, transform=encode_sample)
    loader = DataLoader(workers_ds, batch_size=None, num_workers=2, collate_fn=_identity)
    loaded = list(loader)
    assert len(loaded) == N_SAMPLES
    for i, (a, b) in enumerate(zip(direct, loaded, strict=True)):
        assert_same(a, decode_sample(b), f"sample {i}")


def _read_everything(ds, start, queue):
    start.wait()  # every reader starts at once
    errors = []
    for _ in range(3):
        for i in np.random.default_rng(os.getpid()).permutation(len(ds)).tolist():
            try:
                assert_same(make_sample(i), ds[i], f"sample {i}")
            except AssertionError as exc:
                errors.append(str(exc))
    queue.put((os.getpid(), errors))


def test_two_processes_read_while_the_parent_has_it_open(mixed_path):
    ds = LMDBDataset(mixed_path)
    ds[0]
    ctx = mp.get_context("fork")
    start, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_read_everything, args=(ds, start, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    _read_everything(ds, start, queue)
    reports = [queue.get(timeout=30) for _ in range(3)]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert {pid for pid, _ in reports} == {os.getpid()} | {p.pid for p in procs}
    assert all(errors == [] for _, errors in reports), reports


def test_pickled_copy_reads_and_close_reopens(mixed_path):
    ds = LMDBDataset(mixed_path)
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert_same(make_sample(7), copy[7])
    ds.close()
    assert_same(make_sample(7), ds[7])  # opens again after close
    assert_same(make_sample(8), copy[8])


def test_many_datasets_on_one_file_in_one_process(mixed_path):
    # LMDB forbids opening a file twice in a process: the objects must share one environment.
    first = LMDBDataset(mixed_path)
    first[0]
    second = LMDBDataset(mixed_path, transform=lambda s: s["label"])
    assert second[5] == 5
    assert_same(make_sample(5), first[5])


def test_replaced_file_is_refused_by_old_dataset_in_new_process(tmp_path):
    path = convert_to_lmdb([1, 2], tmp_path / "a.lmdb", progress=False)
    old = LMDBDataset(path)
    convert_to_lmdb([1, 2, 3], path, progress=False)  # atomic replacement: a new file
    assert len(LMDBDataset(path)) == 3
    with pytest.raises(ValueError, match="was replaced since this LMDBDataset was created"):
        old[0]


def test_progress_bar_on_stderr(tmp_path, capsys):
    convert_to_lmdb(list(range(5)), tmp_path / "p.lmdb", progress=True)
    assert "5/5" in capsys.readouterr().err
    convert_to_lmdb(list(range(5)), tmp_path / "q.lmdb", progress=False)
    assert capsys.readouterr().err == ""


def test_map_grows_when_full(tmp_path):
    big = [torch.full((4096,), float(i)) for i in range(40)]  # 640 KiB in a 64 KiB map
    path = convert_to_lmdb(big, tmp_path / "big.lmdb", map_size=64 << 10, progress=False)
    ds = LMDBDataset(path)
    assert len(ds) == 40
    for i in range(40):
        assert_same(big[i], ds[i])


class _Failing:
    def __init__(self, fail_at, action):
        self.fail_at, self.action = fail_at, action

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == self.fail_at:
            self.action()
        return torch.tensor([i])


def _boom():
    raise RuntimeError("disk on fire")


def test_failed_conversion_leaves_no_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "data.lmdb"
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_to_lmdb(_Failing(7, _boom), path, progress=False, commit_every=3)
    assert list(tmp_path.iterdir()) == []  # nor a temporary file

    convert_to_lmdb([torch.tensor([-1])], path, progress=False)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_to_lmdb(_Failing(7, _boom), path, progress=False, commit_every=3)
    ds = LMDBDataset(path)
    assert len(ds) == 1 and ds[0].item() == -1
    assert list(tmp_path.iterdir()) == [path]


def _convert_and_die(path):
    convert_to_lmdb(_Failing(11, lambda: os._exit(3)), path, progress=False, commit_every=3)


def test_killed_conversion_leaves_no_file_at_path(tmp_path):
    path = tmp_path / "data.lmdb"
    proc = mp.get_context("fork").Process(target=_convert_and_die, args=(path,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 3
    assert not path.exists()


def _run_cli(argv):
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize(
    "spec", ["tests.data.lmdb_data:mixed_dataset", "tests.data.lmdb_data:SMALL"]
)
def test_cli_convert_and_info(tmp_path, capsys, spec):
    out = tmp_path / "cli.lmdb"
    argv = ["lmdb", "convert", "--dataset", spec, "--out", str(out), "--map-size", "1M"]
    assert _run_cli([*argv, "--no-progress"]) == 0
    n = len(LMDBDataset(out))
    assert n == (N_SAMPLES if spec.endswith("mixed_dataset") else 5)
    for i in range(n):
        assert_same(make_sample(i), LMDBDataset(out)[i])
    assert f"wrote {n} samples to {out}" in capsys.readouterr().out
    assert _run_cli(["lmdb", "info", str(out)]) == 0
    assert f"{out}: {n} samples" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.data.lmdb_data", "must be MODULE:NAME"),
        ("tests.data.no_such_module:x", "cannot import 'tests.data.no_such_module'"),
        ("tests.data.lmdb_data:nothing", "has no attribute 'nothing'"),
        ("tests.data.lmdb_data:N_SAMPLES", "gave a int, not a map-style data set"),
    ],
)
def test_cli_reports_bad_dataset_spec(tmp_path, capsys, spec, message):
    argv = ["lmdb", "convert", "--dataset", spec, "--out", str(tmp_path / "x.lmdb")]
    assert _run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem lmdb convert: error:") and message in err
    assert not (tmp_path / "x.lmdb").exists()


def test_cli_info_of_missing_file(tmp_path, capsys):
    assert _run_cli(["lmdb", "info", str(tmp_path / "nope.lmdb")]) == 2
    assert f"{tmp_path / 'nope.lmdb'} does not exist" in capsys.readouterr().err


def test_cli_rejects_bad_map_size(capsys):
    with pytest.raises(SystemExit):
        _run_cli(["lmdb", "convert", "--dataset", "m:x", "--out", "x", "--map-size", "lots"])
    assert "'LOTS' is not a size" in capsys.readouterr().err


def test_index_errors_carry_the_values(mixed_path):
    ds = LMDBDataset(mixed_path)
    with pytest.raises(IndexError, match=f"index {N_SAMPLES} out of range for {N_SAMPLES}"):
        ds[N_SAMPLES]
    with pytest.raises(IndexError, match=f"index -{N_SAMPLES + 1} out of range"):
        ds[-N_SAMPLES - 1]
    with pytest.raises(TypeError):
        ds[1.5]


def test_missing_corrupt_and_foreign_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing.lmdb")):
        LMDBDataset(tmp_path / "missing.lmdb")
    garbage = tmp_path / "garbage.lmdb"
    garbage.write_bytes(os.urandom(16384))
    with pytest.raises(ValueError, match=f"cannot open {garbage} as an LMDB file"):
        LMDBDataset(garbage)
    foreign = tmp_path / "foreign.lmdb"
    with lmdb.open(str(foreign), subdir=False, lock=False) as env, env.begin(write=True) as txn:
        txn.put(b"key", b"value")
    with pytest.raises(ValueError, match=f"{foreign} is an LMDB file but not a tandem data set"):
        LMDBDataset(foreign)


def test_lmdb_directory_layout_is_read_too(tmp_path):
    with lmdb.open(str(tmp_path / "dir"), lock=False) as env, env.begin(write=True) as txn:
        txn.put((0).to_bytes(8, "big"), encode_sample(make_sample(0)))
        txn.put(b"__len__", b"1")
        txn.put(b"__format__", b"tandem-lmdb/1")
    assert_same(make_sample(0), LMDBDataset(tmp_path / "dir")[0])


def test_conversion_mistakes_carry_the_values(tmp_path):
    out = tmp_path / "x.lmdb"
    with pytest.raises(ValueError, match=r"sample 1 of 2: sample\['obj'\] is a builtins.object"):
        convert_to_lmdb([{"obj": 1}, {"obj": object()}], out, progress=False)
    with pytest.raises(ValueError, match=r"sample\[0\] is a numpy array of dtype object"):
        convert_to_lmdb([(np.array([None]),)], out, progress=False)
    with pytest.raises(ValueError, match="only dense tensors"):
        convert_to_lmdb([torch.eye(2).to_sparse()], out, progress=False)
    with pytest.raises(ValueError, match="needs a map-style data set"):
        convert_to_lmdb((x for x in range(3)), out, progress=False)
    with pytest.raises(ValueError, match="commit_every=0 must be >= 1"):
        convert_to_lmdb([1], out, progress=False, commit_every=0)
    with pytest.raises(ValueError, match=f"{tmp_path} is a directory"):
        convert_to_lmdb([1], tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_codec_rejects_garbage():
    with pytest.raises(ValueError, match="not an encoded sample"):
        decode_sample(b"\x80\x04pickle")
    data = encode_sample({"x": torch.ones(3)})
    with pytest.raises(ValueError, match="outside a payload"):
        decode_sample(data[:-4])


def test_import_does_not_load_torch_numpy_or_tqdm():
    code = (
        "import sys, tandem.data.lmdb; print(sorted({'torch', 'numpy', 'tqdm'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tandem_command_converts(tmp_path):
    # the real `tandem` command line, as a user types it
    out = tmp_path / "small.lmdb"
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "lmdb",
        "convert",
        "--dataset",
        "tests.data.lmdb_data:SMALL",
        "--out",
        str(out),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    info = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "lmdb", "info", str(out)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "5" in info.stdout
    assert len(LMDBDataset(out)) == 5
