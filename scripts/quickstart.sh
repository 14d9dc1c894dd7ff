#!/usr/bin/env bash
# Installs tnt_notebook and runs the quickstart tutorial (a local 2-rank cluster) top to bottom.
TNT_EXTRAS=tensorflow,examples,notebook
source "$(dirname "$0")/_venv.sh"
mkdir -p build/notebooks
python -m jupyter nbconvert --to notebook --execute notebooks/01_quickstart.ipynb \
  --ExecutePreprocessor.timeout=600 --output-dir build/notebooks
echo "Executed notebook written to build/notebooks/01_quickstart.ipynb"
