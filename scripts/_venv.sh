# Sourced by quickstart.sh and test.sh: one virtual environment, .venv, with tnt_notebook installed
# editable from this checkout with the extras named in $TNT_EXTRAS. Everything comes from the package
# registry: the `mpich` wheel provides mpiexec and libmpi, so no system MPI is needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Build dependencies are installed first so the editable build reuses this environment's MPI.
.venv/bin/python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.13" "mpich>=4.2" cmake ninja
.venv/bin/python -m pip install -q --no-build-isolation -e ".[${TNT_EXTRAS}]"
export PATH="$PWD/.venv/bin:$PATH"
