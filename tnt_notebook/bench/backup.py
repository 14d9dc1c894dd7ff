"""What a backup costs: ``python -m tnt_notebook.bench backup``.

For the ``bench fit`` models with SGD + momentum and with Adam, in one process: the master rank's
time to write one backup (model, optimizer and metric state, atomically), the time to read it
back at the start of a resumed fit, its size, and one training epoch of ``bench fit``'s data for
scale (a backup per epoch costs ``write / epoch`` of the training time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

from tnt_notebook.bench import fit as bench_fit
from tnt_notebook.bench import fit_worker, write_report

OPTIMIZERS = ("sgd_momentum", "adam")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tnt_notebook.bench backup", description=__doc__)
    p.add_argument("--models", default="lenet,mlp", help="comma-separated: lenet, mlp")
    p.add_argument("--samples", type=int, default=32768, help="samples of the timed epoch")
    p.add_argument("--batch", type=int, default=256, help="global batch size of that epoch")
    p.add_argument("--repeats", type=int, default=15, help="backups written (median kept)")
    p.add_argument("--json", default="bench-results/backup.json", help="where to write results")
    return p


def _measure(model_name: str, optimizer: str, args, directory: str) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import tnt_notebook as tnt
    from tnt_notebook.keras import backup

    shape = SimpleNamespace(model=model_name, hidden=512, samples=args.samples, batch=args.batch)
    model = tnt.Model(fit_worker.build_model(keras, shape))
    if optimizer == "adam":
        opt = keras.optimizers.Adam()
    else:
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
    data = fit_worker.synthetic_data(shape, tf, np)
    model.fit(data, epochs=1, verbose=0)  # built, optimizer slots made, caches warm
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0)
    epoch = time.perf_counter() - start

    saver = backup.TrainingBackup(os.path.join(directory, f"{model_name}-{optimizer}"))
    saver.set_model(model)
    writes = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        saver._save(1, 0)
        writes.append(time.perf_counter() - start)
    start = time.perf_counter()
    saver.restore(model)
    read = time.perf_counter() - start
    write = statistics.median(writes)
    return {
        "model": bench_fit.model_name(shape),
        "optimizer": optimizer,
        "parameters": int(model.count_params()),
        "backup_bytes": os.path.getsize(saver.path),
        "write_s": write,
        "read_and_load_s": read,
        "epoch_s": epoch,
        "write_per_epoch": write / epoch,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tnt-bench-backup-") as directory:
        for model_name in args.models.split(","):
            for optimizer in OPTIMIZERS:
                row = _measure(model_name, optimizer, args, directory)
                rows.append(row)
                write, read = row["write_s"] * 1e3, row["read_and_load_s"] * 1e3
                print(
                    f"{row['model']:<48} {optimizer:<13} {row['backup_bytes'] / 1e6:7.2f} MB  "
                    f"write {write:7.1f} ms  read {read:7.1f} ms  epoch {row['epoch_s']:6.2f} s  "
                    f"write/epoch {row['write_per_epoch']:.2%}",
                    flush=True,
                )
    write_report(args.json, {"benchmark": "backup", "args": vars(args), "results": rows})
    return 0
