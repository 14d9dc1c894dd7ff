#!/usr/bin/env bash
# The device check on a machine with an NVIDIA GPU: starts 1 rank (2 where the machine has 2 or
# more GPUs) with tnt-run, shows each rank's CUDA_VISIBLE_DEVICES, the GPUs TensorFlow sees there
# and where a small tnt.Model trains (its weights' device, the GPU memory it used), and exits 0
# only if every rank saw exactly one GPU and trained on it.
#
#   scripts/gpu_check.sh                 # the checkout's .venv (TensorFlow with CUDA: tensorflow[and-cuda])
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# Needs nothing but the package, TensorFlow with CUDA and a GPU driver; writes only a temporary
# directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TNT_RUN="$(dirname "$PYTHON")/tnt-run"

gpus=$("$PYTHON" -m tnt_notebook.cluster.gpu_inventory | grep -c '^GPU ' || true)
echo "gpu_check: the GPU inventory of this machine ($gpus GPU(s)):"
"$PYTHON" -m tnt_notebook.cluster.gpu_inventory | sed 's/^/  /'
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: FAILED: no GPU found here (nvidia-smi -L, /proc/driver/nvidia/gpus)"
    exit 1
fi
ranks=$((gpus >= 2 ? 2 : 1))

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/check.py" <<'EOF'
import os
import sys

import numpy as np

import tnt_notebook as tnt

rank = tnt.get_rank()
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
import keras  # noqa: E402 - after the rank kept its GPU, as any user script
import tensorflow as tf  # noqa: E402

gpus = tf.config.list_physical_devices("GPU")
print(f"rank {rank}: CUDA_VISIBLE_DEVICES={visible!r}; TensorFlow {tf.__version__} "
      f"(built with CUDA: {tf.test.is_built_with_cuda()}) sees {len(gpus)} GPU(s): {gpus}")
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(2)])
model = tnt.Model(model)
model.compile(optimizer="adam",
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=256, epochs=2, verbose=0)
weights = model.trainable_weights[0]
device = getattr(weights.value, "device", "") or getattr(weights, "device", "")
peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] if gpus else 0
print(f"rank {rank}: trained 2 epochs, loss {history.history['loss'][-1]:.4f}; "
      f"weights on {device!r}; GPU:0 memory peak {peak / 2**20:.1f} MiB")
ok = len(gpus) == 1 and "GPU" in device.upper() and peak > 0
print(f"rank {rank}: {'OK: trained on its one GPU' if ok else 'FAILED: not on exactly one GPU'}")
sys.exit(0 if ok else 3)
EOF

echo "gpu_check: tnt-run -n $ranks (one GPU per rank, by the launch rules):"
"$TNT_RUN" -n "$ranks" --dry-run -- "$work/check.py" | sed -n '/devices:/,/exported/p' | sed '$d'
if "$TNT_RUN" -n "$ranks" --output-on-all-devices -- "$work/check.py"; then
    echo "gpu_check: OK: every rank saw exactly its GPU and trained on it"
else
    echo "gpu_check: FAILED (exit status $?)"
    exit 1
fi
