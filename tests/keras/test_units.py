"""Pure helpers of the Keras wrapper, in one process (no MPI world needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_micro_batches_partition_every_global_batch():
    from tnt_notebook.keras.data import micro_batch_bounds

    for n in range(0, 40):
        for size in range(1, 6):
            bounds = [micro_batch_bounds(n, size, r) for r in range(size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            counts = [hi - lo for lo, hi in bounds]
            assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize(
    "batch, micro, size, ok",
    [
        (16, None, 2, True),
        (16, 8, 2, True),
        (17, 8, 2, True),
        (17, 9, 2, True),
        (17, 7, 2, False),
        (16, 4, 2, False),
        (1, None, 2, False),
        (3, None, 3, True),
        (5, 0, 1, False),
    ],
)
def test_batch_size_checks(batch, micro, size, ok):
    from tnt_notebook.keras.data import check_batch_sizes

    if ok:
        check_batch_sizes(batch, micro, size)
    else:
        with pytest.raises(ValueError):
            check_batch_sizes(batch, micro, size)


@pytest.mark.parametrize(
    "labels",
    [
        [0, 1, 2, 3],  # class ids
        [[0], [1], [2], [3]],  # a column of class ids
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],  # one-hot rows
    ],
)
def test_class_weights_become_sample_weights_and_missing_classes_weigh_one(labels):
    import numpy as np
    import tensorflow as tf

    from tnt_notebook.keras.data import with_class_weights

    y = np.array(labels, dtype=np.float32)
    ds = with_class_weights(tf.data.Dataset.from_tensors((np.zeros((4, 2)), y)), {0: 0.5, 2: 3})
    (_, _, weights) = next(iter(ds))
    assert weights.numpy().tolist() == [0.5, 1.0, 3.0, 1.0]


@pytest.mark.parametrize("class_weight", [{}, {-1: 2.0}, {"cat": 2.0}])
def test_class_weight_without_integer_class_ids_is_rejected(class_weight):
    import tensorflow as tf

    from tnt_notebook.keras.data import with_class_weights

    with pytest.raises(ValueError, match="class ids"):
        with_class_weights(tf.data.Dataset.from_tensors(([0.0], [0])), class_weight)


def test_importing_the_package_does_not_import_tensorflow():
    code = "import sys, tnt_notebook; assert not {'tensorflow', 'keras'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_compression_casts_wide_floats_only_and_back_and_names_its_choices():
    import tensorflow as tf

    import tnt_notebook as tnt

    tensors = [tf.ones(3, tf.float32), tf.ones(2, tf.float64), tf.ones(1, tf.int32)]
    assert tnt.Compression.of(None) is tnt.Compression.none
    assert tnt.Compression.of("none").compress(tensors) == tensors
    for name, dtype in (("fp16", tf.float16), ("bf16", tf.bfloat16)):
        c = tnt.Compression.of(name)
        assert c is getattr(tnt.Compression, name) and tnt.Compression.of(c) is c
        sent = c.compress(tensors)
        assert [t.dtype for t in sent] == [dtype, dtype, tf.int32]
        back = c.decompress(sent, tensors)
        assert [t.dtype for t in back] == [tf.float32, tf.float64, tf.int32]
    with pytest.raises(ValueError, match=r"tnt.Compression.none, .fp16 or .bf16 .*got 'int8'"):
        tnt.Compression.of("int8")


def test_a_tnt_model_takes_its_compression_and_rejects_unknown_ones():
    import keras

    import tnt_notebook as tnt

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert tnt.Model(model)._tnt.compression is tnt.Compression.none
    wrapped = tnt.Model(model, compression="fp16")
    assert wrapped._tnt.compression is tnt.Compression.fp16
    assert tnt.Model(wrapped)._tnt.compression is tnt.Compression.fp16  # kept when not given
    assert tnt.Model(wrapped, compression=None)._tnt.compression is tnt.Compression.fp16
    assert tnt.Model(wrapped, compression="none")._tnt.compression is tnt.Compression.none
    with pytest.raises(ValueError, match="got 'zip'"):
        tnt.Model(model, compression="zip")


def test_callbacks_that_may_read_weights_between_steps_are_told_apart():
    """With TNT_OVERLAP=steps, the update is applied after every step only for these."""
    import keras

    import tnt_notebook as tnt
    from tnt_notebook.keras.callbacks import may_read_weights_between_steps as reads

    class Logs(keras.callbacks.Callback):
        reads_weights_each_batch = False

        def on_train_batch_end(self, batch, logs=None):
            pass

    class Own(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            pass

    def hook(*args, **kwargs):
        pass

    check = keras.callbacks.ModelCheckpoint
    assert reads(check("m.keras", save_freq=5)) and reads(
        tnt.keras.callbacks.Callback(check("m.keras", save_freq=5))
    )
    assert reads(Own()) and reads(keras.callbacks.LambdaCallback(on_train_batch_end=hook))
    assert not reads(check("m.keras")) and not reads(Logs())
    assert not reads(keras.callbacks.LambdaCallback(on_epoch_end=hook))
    assert not reads(keras.callbacks.EarlyStopping()) and not reads(
        keras.callbacks.CSVLogger("l.csv")
    )
