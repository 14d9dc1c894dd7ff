#!/usr/bin/env bash
# Installs everything the tests need (Python packages; GPI-2 for the GASPI transport where its
# source lies beside the repository; as root, Debian's chromium for the browser test and what the
# multi-host test worlds need: iproute2, openssh-server, and the test Slurm's slurmctld, slurmd,
# slurm-client) and runs the tests, those marked slow left out (pyproject.toml's addopts). Extra
# arguments go to pytest: -m slow runs those, -m "" every test.
cd "$(dirname "$0")/.."
source scripts/_gpi2.sh
TNT_EXTRAS=test
source scripts/_venv.sh
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v nsenter >/dev/null || missing+=(util-linux)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
slurm=()  # the test Slurm; without recommends, which would bring 33 more packages (hdf5, rrd...)
[ -x /usr/sbin/slurmctld ] || slurm+=(slurmctld)
[ -x /usr/sbin/slurmd ] || slurm+=(slurmd)
command -v srun >/dev/null || slurm+=(slurm-client)
if [ $((${#missing[@]} + ${#slurm[@]})) -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq; then
    [ ${#missing[@]} -eq 0 ] || apt-get install -y -qq "${missing[@]}" >/dev/null
    [ ${#slurm[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${slurm[@]}" >/dev/null
  fi
fi
python -m pytest "$@"
