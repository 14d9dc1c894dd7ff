"""No training lost: BackupAndRestore with tnt.Model resumes exactly where its backup was taken,
and every file-writing callback writes once, from the master rank, files that load.

The ranks run in mount namespaces of their own with a private directory at the same path (as
hosts without a shared filesystem): only the master rank ever holds the files.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.keras_worlds import ENV, run_worker
from tests.support.mpiworld import run_with_deadline

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="private directories need mount namespaces (root)"
    ),
]

RESUMED = [
    "sgd_momentum/epoch/arrays",
    "adam_schedule/2_batches/tf.data",
    "sgd_momentum/3_batches/arrays/dropout_validation",
]


@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["2-ranks", "3-ranks"]
)
def world(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("backup")
    private = out / "host"
    private.mkdir()
    own_tmpfs = ("unshare", "--mount", "--propagation", "private", "sh", "-c")
    mount = 'mount -t tmpfs -o mode=0700 tnt-host "$0" && exec "$@"'
    per_rank, _ = run_worker(
        request.param,
        "backup_worker",
        out,
        timeout=900,
        env={"TNT_PRIVATE_DIR": str(private)},
        mpi_args=(*own_tmpfs, mount, str(private)),
    )
    assert list(private.iterdir()) == []  # nothing reached the shared directory underneath
    return per_rank


@pytest.mark.parametrize("scenario", RESUMED)
def test_a_rerun_after_a_failure_resumes_exactly_where_the_backup_was_taken(world, scenario):
    last = len(world) - 1
    for rank, r in enumerate(world):
        res = r[scenario]
        assert res["interrupted"] == ("RuntimeError" if rank == last else "CollectiveAbortedError")
        # the backup lives on the master rank alone
        assert res["backup_files"] == (["tnt-backup.npz"] if rank == 0 else [])
        assert res["state_abs"] <= 1e-6, f"rank {rank}: weights and optimizer state"
        assert res["history_rel"] <= 1e-6 and res["same_keys"], f"rank {rank}: history"
        assert res["history_lengths"] == [4]  # every epoch, also those before the backup
        assert res["left_after_success"] is False


def test_a_damaged_latest_backup_is_never_taken(world):
    for r in world:
        res = r["corrupt_with_previous"]
        assert res["state_abs"] <= 1e-6 and res["history_rel"] <= 1e-6  # from the previous one
        kind, text = r["corrupt_alone"]["error"]
        assert kind in ("BackupError", "RankOperationError") and "unusable" in text


def test_checkpoint_csv_and_tensorboard_files_are_written_once_by_the_master(world):
    for rank, r in enumerate(world):
        c = r["checkpoints"]
        if rank != 0:
            assert c["files"] == []
            continue
        assert c["files"] == [
            "batch.keras",
            "best.weights.h5",
            "epoch1.keras",
            "epoch2.keras",
            "epoch3.keras",
            "epoch4.keras",
            "log.csv",
            "tb",
            "w1.weights.h5",
            "w2.weights.h5",
            "w3.weights.h5",
            "w4.weights.h5",
        ]
        assert c["no_temporary_files"]
        assert c["loads"] == {
            "last_epoch_model": True,
            "last_epoch_weights": True,
            "batch_model": 4,
            "csv_rows": 4,
        }


def test_a_backup_write_that_dies_partway_leaves_the_previous_backup_whole(tmp_path):
    """The master's next backup dies half written (a full disk): the last backup is still the
    same bytes, and loads. In one plain process (a 1-rank world)."""
    code = f"""
import json, os, numpy as np, keras, tnt_notebook as tnt
from tnt_notebook.keras import backup

x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = x[:, :2] * 2.0
model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
model.compile("sgd", "mse")


def fit(epochs):
    saves = keras.callbacks.BackupAndRestore({str(tmp_path)!r}, delete_checkpoint=False)
    model.fit(x, y, batch_size=8, epochs=epochs, callbacks=[saves], verbose=0)


fit(1)
path = os.path.join({str(tmp_path)!r}, backup.LATEST)
good = open(path, "rb").read()


def dies_partway(target, meta, arrays):
    with open(target, "wb") as f:
        f.write(good[: len(good) // 2])
    raise OSError(28, "No space left on device")


backup._write = dies_partway
try:
    fit(2)
    raised = None
except OSError as exc:
    raised = str(exc)
meta, _ = backup._load(path)
print(json.dumps({{"raised": raised, "same": open(path, "rb").read() == good,
                  "epoch": meta["epoch"]}}))
"""
    proc = run_with_deadline([sys.executable, "-c", code], env={**os.environ, **ENV}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"raised": "[Errno 28] No space left on device", "same": True, "epoch": 1}
