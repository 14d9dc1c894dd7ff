"""Writes the tutorial notebooks from the cell sources below (the single source of truth).

    python notebooks/build_notebooks.py            # write the .ipynb files without outputs
    python notebooks/build_notebooks.py --execute  # also run them and keep their outputs

The outputs are kept for readers (the documentation renders the tutorials with them); nbval
(``pytest notebooks``) re-runs every notebook and compares the outputs of the cells marked
NBVAL_CHECK_OUTPUT, sanitized with nbval_sanitize.cfg.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
CHECK = "# NBVAL_CHECK_OUTPUT"

LENET = '''\
def lenet(seed=42):
    """A LeNet-5-like convolutional network for 8x8 grey images (same weights for the same seed)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(120, activation="relu"),
        keras.layers.Dense(84, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def compile_model(model, learning_rate=3e-3):
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model'''

DIGITS = """\
import os
import numpy as np
import keras
import tnt_notebook as tnt
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

digits = load_digits()  # 1797 8x8 images of hand-written digits, shipped with scikit-learn
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)"""


def model_setup_cell(extra: str = ""):
    """Data, model builder and a first model on the ranks (TensorFlow starts up here)."""
    return code(f"""
%%tnt
{DIGITS}
{extra}

{LENET}


_ = lenet()  # the first model: TensorFlow starts up here
""")


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


def tagged(cell, *tags: str):
    """A cell with tags (``raises-exception``: nbclient and nbval expect its error)."""
    cell.metadata["tags"] = list(tags)
    return cell


def quickstart() -> list:
    return [
        md("""
# Quickstart: data-parallel Keras from a notebook

This notebook trains a small convolutional network on two MPI ranks, each of them an
ipyparallel engine, and compares the result with ordinary serial training.

1. `%load_ext tnt_notebook` registers the magics (the *Python 3 (tnt_notebook)* kernel, installed
   with `tnt-notebook-kernelspec install --user`, loads it for you).
2. `%tnt_cluster -n 2` starts two ranks on this machine.
3. Cells starting with `%%tnt` run on every rank; only the master rank's output is shown.
"""),
        code("%load_ext tnt_notebook"),
        code("%tnt_cluster -n 2"),
        md("""
## Data
Scikit-learn ships the *digits* data set, so nothing is downloaded. Every rank loads the whole
data set; `tnt.Model` gives each rank its share of every global batch.
"""),
        code(f"""
%%tnt
{DIGITS}
"""),
        code(f"""
%%tnt
{CHECK}
print(f"rank {{tnt.get_rank()}} of {{tnt.get_size()}}:",
      f"{{len(x_train)}} training and {{len(x_test)}} test images")
"""),
        md("""
## Model
Any Keras model works: wrap it in `tnt.Model` and use `compile` / `fit` / `evaluate` /
`predict` as usual. `batch_size` is the **global** batch size: with 2 ranks each rank computes
gradients on 32 of the 64 samples of every batch, and the gradients are averaged with a fused
allreduce before every update, so all ranks hold the same weights at all times.

While `fit` runs, the notebook shows one live progress display fed by the master rank with
values aggregated over all ranks.
"""),
        code(f"""
%%tnt
{LENET}


model = compile_model(tnt.Model(lenet()))
history = model.fit(x_train, y_train, batch_size=64, epochs=10, validation_data=(x_test, y_test))
"""),
        code(f"""
%%tnt
{CHECK}
loss, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
print("test accuracy above 90%:", accuracy > 0.9)
print("history keys:", sorted(history.history))
"""),
        md("""
## Same result as serial training
Data-parallel training computes exactly the gradient of the global batch. To see it, train
the same network from the same initial weights twice, without shuffling: once with `tnt.Model`
on both ranks, once with plain Keras on the master rank only.
"""),
        code(f"""
%%tnt
{CHECK}
import time


class EpochTimes(keras.callbacks.Callback):
    # each epoch's wall-clock time: the first one traces the step, the others are steady

    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


parallel, t_parallel = compile_model(tnt.Model(lenet(seed=7))), EpochTimes()
h_parallel = parallel.fit(x_train, y_train, batch_size=64, epochs=3, shuffle=False, verbose=0,
                          callbacks=[t_parallel])

if tnt.is_master_rank():
    serial, t_serial = compile_model(lenet(seed=7)), EpochTimes()
    h_serial = serial.fit(x_train, y_train, batch_size=64, epochs=3, shuffle=False, verbose=0,
                          callbacks=[t_serial])
    diff = np.max(np.abs(np.subtract(h_parallel.history["loss"], h_serial.history["loss"])))
    print("same loss curve as serial training:", bool(diff < 1e-3))
    weights = [np.max(np.abs(a - b)) for a, b in zip(parallel.get_weights(), serial.get_weights())]
    print("same final weights:", bool(max(weights) < 1e-3))
"""),
        code("""
%%tnt
if tnt.is_master_rank():
    for name, times in (("2 ranks", t_parallel.times), ("serial", t_serial.times)):
        steady = min(times[1:])
        print(f"{name:>7}: first epoch {times[0]:.2f} s (tracing the step), "
              f"then {steady:.2f} s per epoch = {len(x_train) / steady:,.0f} samples/s")
"""),
        md("""
The first epoch of each fit traces the train step once; compare the epochs after it. A model this
small computes a batch of 64 in about a millisecond: two ranks that share a small machine can be
slower than one, since the allreduce and Keras's own work per step weigh more than the compute
they split. Larger models and batches, and ranks with cores of their own, are where data
parallelism pays (`python -m tnt_notebook.bench fit` measures it). The
performance tutorial's section *Why is my fit slow?* shows where each rank's step time goes
(`%tnt_timeline`).
"""),
        md("Stop the ranks when you are done (restarting the kernel stops them too)."),
        code("%tnt_cluster stop"),
        md("""
## On a cluster: Slurm and JupyterHub

The same notebook runs on many nodes. With a hostfile, `%tnt_cluster --hostfile hosts
--n-per-node 4` starts 4 ranks on each host it names (reached with ssh). Inside a Slurm
allocation, `%tnt_cluster` alone takes the job's nodes and as many ranks per node as the job
grants (`--n-per-node` chooses), as one job step that Slurm starts and ends; `%tnt_cluster
status` names the job. On a JupyterHub whose notebook servers are Slurm jobs (batchspawner's
`SlurmSpawner`), ask the spawner for the nodes, e.g. `--nodes=2 --ntasks-per-node=4`, and start
the cluster with `%tnt_cluster` in the notebook; stopping the server ends the job and the cluster
with it. The guide's page *Slurm and JupyterHub* tells the details.
"""),
    ]


def ranks_callbacks_checkpoints() -> list:
    return [
        md("""
# Ranks, callbacks and checkpoints

Each rank is an MPI process and an ipyparallel engine; engine id, MPI rank and
`tnt.get_rank()` are the same number. The master rank (rank 0) is the one whose output the
notebook shows.
"""),
        code("%load_ext tnt_notebook"),
        code("%tnt_cluster -n 2"),
        md("""
## The rank API
`get_rank`, `get_size`, `is_master_rank`, `barrier`, `broadcast` and `allreduce` work on every
rank. `%%tnt --all-ranks` shows the output of every rank (identical outputs are merged).
"""),
        code(f"""
%%tnt --all-ranks
{CHECK}
import numpy as np
import tnt_notebook as tnt

rank, size = tnt.get_rank(), tnt.get_size()
print(f"I am rank {{rank}} of {{size}}; master: {{tnt.is_master_rank()}}")
"""),
        code(f"""
%%tnt
{CHECK}
total = tnt.allreduce(np.array([rank + 1.0]), op="sum")
largest = tnt.allreduce(np.array([float(rank)]), op="max")
greeting = tnt.broadcast(f"hello from rank {{rank}}", root=0)
print(total, largest, greeting)
"""),
        md("""
## Master-only work
Work that should happen once - writing a file, printing a report - goes under
`if tnt.is_master_rank():`. A `barrier` makes the other ranks wait until it is done.
"""),
        code(f"""
%%tnt
{CHECK}
import os
import tempfile

# one scratch directory, chosen on the master rank and shared with the others
workdir = tnt.broadcast(tempfile.mkdtemp(prefix="tnt_tutorial_") if tnt.is_master_rank() else None)
if tnt.is_master_rank():
    with open(os.path.join(workdir, "report.txt"), "w") as f:
        f.write("written once\\n")
tnt.barrier()
print(open(os.path.join(workdir, "report.txt")).read().strip(), "- visible on rank", rank)
"""),
        md("## A model to train"),
        model_setup_cell(),
        md("""
## Callbacks
Plain Keras callbacks passed to `fit` run on every rank and see **aggregated** logs (the loss
and metrics of the whole global batch), so `EarlyStopping`, `ReduceLROnPlateau` or
`LearningRateScheduler` take the same decision on every rank. Callbacks that only write -
`ModelCheckpoint`, `CSVLogger`, `TensorBoard`, progress bars - run on the master rank only.

`tnt.keras.callbacks.Callback(cb, run_on_all_ranks=False)` runs a callback on the master rank
only. Tarantella's `aggregate_logs=False` is accepted and changes nothing: the metric states are
reduced inside every step, so there are no rank-local logs to hand out.
"""),
        code(f"""
%%tnt --all-ranks
{CHECK}
class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(logs["loss"])


aggregated, local = Record(), Record()
checkpoints = os.path.join(workdir, "checkpoints")
model = compile_model(tnt.Model(lenet()))
history = model.fit(
    x_train, y_train, batch_size=64, epochs=4, verbose=0,
    validation_data=(x_test, y_test),
    callbacks=[
        aggregated,
        tnt.keras.callbacks.Callback(local, aggregate_logs=False),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
        keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "epoch{{epoch}}.weights.h5"),
                                        save_weights_only=True),
    ],
)
tnt.barrier()
same = np.allclose(aggregated.losses, history.history["loss"])
print("aggregated losses equal the history:", same)
print("checkpoints:", sorted(os.listdir(checkpoints)))
"""),
        code("""
%%tnt --all-ranks
# aggregate_logs=False or not, every rank saw the losses of whole global batches
print("losses:", np.round(local.losses, 3))
"""),
        md("""
## Saving and loading
`model.save(...)`, `save_weights` and `tnt.models.save_model` write on the master rank only
(followed by a barrier, so every rank can read the file right away). `tnt.models.load_model`
returns a `tnt.Model`, compiled if it was saved compiled.
"""),
        code(f"""
%%tnt
{CHECK}
path = os.path.join(workdir, "digits.keras")
model.save(path)
restored = tnt.models.load_model(path)
print("a tnt.Model:", isinstance(restored, tnt.Model), "compiled:", restored.compiled)
same = [np.array_equal(a, b) for a, b in zip(model.get_weights(), restored.get_weights())]
print("same weights:", all(same))
before, after = model.predict(x_test, verbose=0), restored.predict(x_test, verbose=0)
print("same predictions:", np.allclose(before, after))
"""),
        code(f"""
%%tnt
{CHECK}
# resume from a checkpoint: load_weights reads the file and makes all ranks agree
resumed = tnt.Model(lenet(seed=1))
resumed.load_weights(os.path.join(checkpoints, "epoch2.weights.h5"))
compile_model(resumed)
loss, accuracy = resumed.evaluate(x_test, y_test, verbose=0)
print("resumed from epoch 2, test accuracy above 50%:", accuracy > 0.5)
"""),
        code("""
%%tnt
import shutil

tnt.barrier()
if tnt.is_master_rank():
    shutil.rmtree(workdir)
"""),
        md("""
## Surviving a lost rank
A long training run must not lose its hours when a node fails. Keras's `BackupAndRestore`
callback works with `tnt.Model`: the master rank backs up the model, the optimizer, the epoch
and the step within it, and the same `fit`, run again, continues from the last backup exactly
as an uninterrupted run would have. The training below sits in a script, so that it can simply
be run again after a restart. The first time it reaches its third epoch, it loses rank 1
(SIGKILL), as if a node had failed.
"""),
        code(TRAIN_DIGITS),
        tagged(code("%%tnt\n%run train_digits.py"), "raises-exception"),
        md("""
The cell ends at once, naming the lost rank. Start the ranks again and run the same script: it
resumes from the backup written at the end of the second epoch.
"""),
        code("%tnt_cluster restart"),
        code(f"""
%%tnt
{CHECK}
%run train_digits.py
resumed = model.get_weights()
"""),
        md("""
No backup is left behind once training completes, and rank 1 is not lost a second time: running
the script once more is an uninterrupted run, which ends with the same weights.
"""),
        code(f"""
%%tnt
{CHECK}
%run train_digits.py
same = all(np.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(resumed, model.get_weights()))
print("the resumed run ends where the uninterrupted one ends:", same)
"""),
        code("""
import os

for leftover in ("train_digits.py", "rank-1-was-lost"):
    os.remove(leftover)
"""),
        code("%tnt_cluster stop"),
    ]


TRAIN_DIGITS = '''\
%%writefile train_digits.py
"""Digits training that survives a lost rank: run it again after %tnt_cluster restart."""
import os
import signal

import keras
import numpy as np
import tnt_notebook as tnt
from sklearn.datasets import load_digits

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target.astype("int32")


class LoseRankOneOnce(keras.callbacks.Callback):
    """Kills rank 1 as the third epoch begins, the first time only: a node failing."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2 and tnt.get_rank() == 1 and not os.path.exists("rank-1-was-lost"):
            open("rank-1-was-lost", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


keras.utils.set_random_seed(42)
model = tnt.Model(keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(8, 3, activation="relu"),
    keras.layers.Flatten(),
    keras.layers.Dense(10, activation="softmax"),
]))
model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(
    x, y, batch_size=64, epochs=4, verbose=0,
    callbacks=[keras.callbacks.BackupAndRestore("digits-backup"), LoseRankOneOnce()],
)
print("epochs in the history:", len(history.history["loss"]),
      "- final accuracy above 90%:", history.history["accuracy"][-1] > 0.9)
'''


def datasets_and_batch_sizes() -> list:
    return [
        md("""
# Data sets and batch sizes

`tnt.Model` takes the **global** batch size, the one you would use for serial training. With
`p` ranks, each global batch of `n` samples is split into `p` contiguous micro-batches: rank
`r` gets samples `[r*n//p, (r+1)*n//p)`. Gradients are weighted by the micro-batch sizes, so the
update is exactly the serial one, also when `n` is not a multiple of `p` or the last batch is
short.
"""),
        code("%load_ext tnt_notebook"),
        code("%tnt_cluster -n 2"),
        model_setup_cell("import tensorflow as tf\n"),
        md("""
## NumPy arrays and `tf.data`
NumPy arrays with `batch_size=64` and a `tf.data.Dataset` batched by 64 give the same
training. A dataset must be batched with the global batch size; every rank iterates the same
dataset and keeps its slice of each batch.
"""),
        code(f"""
%%tnt
{CHECK}
from_arrays = compile_model(tnt.Model(lenet()))
h_arrays = from_arrays.fit(x_train, y_train, batch_size=64, epochs=2, shuffle=False, verbose=0)

dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(64)
from_dataset = compile_model(tnt.Model(lenet()))
h_dataset = from_dataset.fit(dataset, epochs=2, verbose=0)
print("same losses:", np.allclose(h_arrays.history["loss"], h_dataset.history["loss"], rtol=1e-4))
"""),
        md("""
## Micro-batch size
`tnt_micro_batch_size` states the per-rank batch size explicitly; it must agree with the
global batch size and the number of ranks, otherwise `fit` refuses to start (on every rank,
with the same message).
"""),
        code(f"""
%%tnt
{CHECK}
model = compile_model(tnt.Model(lenet()))
model.fit(x_train, y_train, batch_size=64, tnt_micro_batch_size=32, epochs=1, verbose=0)
print("64 = 2 ranks x 32: accepted")
try:
    model.fit(x_train, y_train, batch_size=64, tnt_micro_batch_size=20, epochs=1, verbose=0)
except ValueError as error:
    print("64 != 2 ranks x 20:", type(error).__name__)
"""),
        md("""
## Uneven batches
A global batch of 65 gives micro-batches of 32 and 33 samples; 1347 training images make 20
full batches and a last one of 47 (23 + 24). The result still equals serial training.
"""),
        code(f"""
%%tnt
{CHECK}
uneven = compile_model(tnt.Model(lenet(seed=3)))
h_uneven = uneven.fit(x_train, y_train, batch_size=65, epochs=2, shuffle=False, verbose=0)
if tnt.is_master_rank():
    serial = compile_model(lenet(seed=3))
    h_serial = serial.fit(x_train, y_train, batch_size=65, epochs=2, shuffle=False, verbose=0)
    print("batch 65 on 2 ranks equals serial:",
          np.allclose(h_uneven.history["loss"], h_serial.history["loss"], rtol=1e-4))
"""),
        md("""
## Learning-rate scaling with warm-up
When you add ranks to train faster, you usually grow the global batch with them (keeping the
micro-batch constant) and scale the learning rate by the same factor (Goyal et al., 2017). A
few epochs of linear warm-up avoid the instability of a large learning rate at the start. A
`LearningRateScheduler` does it; like every callback that changes training it runs on every
rank, so all ranks use the same rate.
"""),
        code(f"""
%%tnt
{CHECK}
micro_batch, base_lr, warmup_epochs = 32, 1e-3, 3
global_batch = micro_batch * tnt.get_size()
target_lr = base_lr * tnt.get_size()


def warmup(epoch, lr):
    return target_lr * min(1.0, (epoch + 1) / warmup_epochs)


model = compile_model(tnt.Model(lenet()), learning_rate=base_lr)
history = model.fit(
    x_train, y_train, batch_size=global_batch, epochs=5, verbose=0,
    callbacks=[keras.callbacks.LearningRateScheduler(warmup)],
)
print("global batch", global_batch, "learning rate per epoch:",
      [round(float(lr), 6) for lr in history.history["learning_rate"]])
"""),
        code("%tnt_cluster stop"),
    ]


def performance() -> list:
    return [
        md("""
# Performance: fusion, allreduce and scaling

After every backward pass the ranks sum their gradients with an allreduce. Small tensors are
packed into *fusion buckets* so that one collective moves many of them; the bucket size is the
fusion threshold (`%tnt_cluster --fusion-threshold KB`, 32 KB by default).
"""),
        code("%load_ext tnt_notebook"),
        code("%tnt_cluster -n 2 --fusion-threshold 64"),
        code("""
%%tnt
import os
import time
import numpy as np
import keras
import tnt_notebook as tnt

keras.utils.set_random_seed(0)
mlp = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                        keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
"""),
        code(f"""
%%tnt
{CHECK}
print("fusion threshold on the ranks:", os.environ["TNT_FUSION_THRESHOLD"], "bytes")
specs = [(tuple(v.shape), "float32") for v in reversed(mlp.trainable_weights)]
for threshold in (0, 4 * 1024, 64 * 1024, 4 * 1024 * 1024):
    plan = tnt.FusedAllreduce(specs, threshold_bytes=threshold)
    print(f"threshold {{threshold:>8}} B: {{len(plan.buckets)}} buckets {{plan.buckets}}")
"""),
        md("""
## Allreduce against MPI
The native allreduce is compared with `MPI_Allreduce` (mpi4py) on the same buffers. Bus
bandwidth is `bytes / time * 2 (p-1) / p`. Arrays from `tnt.empty` live in memory that the
other ranks of the node can map, so the allreduce reads and writes them in place instead of
copying them through its shared segment: the third curve. For the full table, run
`python -m tnt_notebook.bench allreduce` in a terminal.
"""),
        code("""
%%tnt
from mpi4py import MPI

comm = MPI.COMM_WORLD
p = tnt.get_size()


def best_time(fn, repeats):
    times = []
    for _ in range(repeats):
        tnt.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


results = {"bytes": [], "tnt": [], "tnt shared": [], "mpi": []}
for size in [2**k for k in range(10, 25, 2)]:  # 1 KB ... 16 MB of float32
    a = np.ones(size // 4, dtype=np.float32)
    out = np.empty_like(a)
    shared, shared_out = tnt.empty(a.shape), tnt.empty(a.shape)
    shared[:] = 1
    repeats = 20 if size < 2**22 else 5
    times = {
        "tnt": best_time(lambda: tnt.allreduce(a, out=out), repeats),
        "tnt shared": best_time(lambda: tnt.allreduce(shared, out=shared_out), repeats),
        "mpi": best_time(lambda: comm.Allreduce(a, out, op=MPI.SUM), repeats),
    }
    results["bytes"].append(size)
    for name, t in times.items():
        results[name].append(size / t * 2 * (p - 1) / p / 1e9)
"""),
        code("%tnt_pull results"),
        code("""
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogx(results["bytes"], results["tnt"], "o-", label="tnt_notebook allreduce")
ax.semilogx(results["bytes"], results["tnt shared"], "^-", label="... on tnt.empty arrays")
ax.semilogx(results["bytes"], results["mpi"], "s--", label="MPI_Allreduce (mpi4py)")
ax.set_xlabel("message size (bytes)")
ax.set_ylabel("bus bandwidth (GB/s)")
ax.set_title("allreduce between 2 local ranks")
ax.legend()
plt.show()
"""),
        md("""
## Scaling of `fit`
The same MLP and global batch of 256: plain Keras in one process (on the master rank, while
the other rank waits) against `tnt.Model` on both ranks. On this 2-core machine the ranks share
the cores with everything else, so take the numbers as an illustration;
`python -m tnt_notebook.bench fit` measures 1 and 2 ranks and `tf.distribute` properly.
"""),
        code("""
%%tnt
rng = np.random.default_rng(0)
x = rng.normal(size=(256 * 20, 784)).astype("float32")
y = rng.integers(0, 10, size=len(x))


def throughput(model, epochs=3):
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)  # warm-up: tracing, first steps
    start = time.perf_counter()
    model.fit(x, y, batch_size=256, epochs=epochs, verbose=0)
    return epochs * len(x) / (time.perf_counter() - start)


parallel = throughput(tnt.Model(keras.models.clone_model(mlp)))
if tnt.is_master_rank():
    serial = throughput(keras.models.clone_model(mlp))
    print(f"plain Keras, 1 process: {serial:8.0f} samples/s")
    print(f"tnt.Model, {p} ranks:     {parallel:8.0f} samples/s "
          f"(speed-up {parallel / serial:.2f}, efficiency {parallel / (p * serial):.0%})")
"""),
        md("""
## Why is my fit slow?
`%tnt_timeline on` makes each later `fit` record a few train steps on every rank (after the
first two, which trace): the input pipeline, forward and backward compute, each fusion bucket's
allreduce, the time spent waiting for the slowest rank, and the optimizer's update. `%tnt_timeline
show` plots the last fit's steps, ranks as rows on one time axis, and sums them up per rank; the
same numbers are `tnt.timeline_summary()` on the master rank. Here rank 1 sleeps 20 ms in its
input pipeline at every batch: rank 0 spends that time waiting for it, and the summary names rank
1 the straggler.
"""),
        code("%tnt_timeline on --steps 8"),
        code("""
%%tnt
import tensorflow as tf


def slowly(x, y):  # 20 ms more for each batch
    x = tf.numpy_function(lambda a: time.sleep(0.02) or a, [x], tf.float32, stateful=True)
    return tf.ensure_shape(x, [None, 784]), y


data = tf.data.Dataset.from_tensor_slices((x, y)).batch(256).take(12)
if tnt.get_rank() == 1:  # only rank 1's input pipeline is slow
    data = data.map(slowly)
model = tnt.Model(keras.models.clone_model(mlp))
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(data, epochs=1, verbose=0)
summary = tnt.timeline_summary()
"""),
        code("%tnt_timeline show"),
        code(f"""
%%tnt
{CHECK}
if tnt.is_master_rank():
    print("straggler:", summary["straggler"])
    print("rank 0 waits longer than rank 1:",
          summary["ranks"][0]["wait_s"] > summary["ranks"][1]["wait_s"])
"""),
        code("%tnt_timeline off"),
        code("%tnt_cluster stop"),
    ]


NOTEBOOKS = {
    "01_quickstart.ipynb": quickstart,
    "02_ranks_callbacks_checkpoints.ipynb": ranks_callbacks_checkpoints,
    "03_datasets_and_batch_sizes.ipynb": datasets_and_batch_sizes,
    "04_performance.ipynb": performance,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"
    return nb


def number_cells(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Execution counts in order (nbval refuses reference outputs of unrun cells), no cell
    metadata but tags, no widget state (the progress views end as static HTML and text)."""
    count = 0
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        for out in cell.outputs:
            if "execution_count" in out:
                out["execution_count"] = count
    nb.metadata.pop("widgets", None)
    return nb


def reuse_expected_outputs(nb: nbformat.NotebookNode, path: Path) -> None:
    """Keep the committed outputs of cells whose source did not change."""
    if not path.exists():
        return
    old = {c.get("id"): c for c in nbformat.read(path, as_version=4).cells}
    for cell in nb.cells:
        before = old.get(cell.get("id"))
        if cell.cell_type == "code" and before is not None and before.source == cell.source:
            cell.outputs = before.get("outputs", [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(NOTEBOOKS), help="notebooks to write")
    parser.add_argument("--execute", action="store_true", help="run them and keep the outputs")
    args = parser.parse_args(argv)
    for name in args.names:
        nb = build(name)
        if args.execute:
            from nbclient import NotebookClient

            client = NotebookClient(
                nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
            )
            client.execute()
        else:
            reuse_expected_outputs(nb, HERE / name)
        number_cells(nb)
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
