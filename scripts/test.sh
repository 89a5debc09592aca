#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite with real sockets,
# processes, Spark and Delta. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -p no:cacheprovider -q "$@"
