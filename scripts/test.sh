#!/usr/bin/env bash
# Installs everything the tests need (Python packages, and Debian's chromium for the browser test
# when run as root) and runs every test. Extra arguments go to pytest.
TNT_EXTRAS=test
source "$(dirname "$0")/_venv.sh"
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
python -m pytest "$@"
