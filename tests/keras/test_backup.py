"""No training lost: BackupAndRestore with tnt.Model resumes exactly where its backup was taken,
and every file-writing callback writes once, from the master rank, files that load.

The ranks run in mount namespaces of their own with a private directory at the same path (as
hosts without a shared filesystem): only the master rank ever holds the files.
"""

from __future__ import annotations

import os

import pytest
from keras_worlds import run_worker

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
