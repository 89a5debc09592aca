#!/usr/bin/env bash
# The README's main command: set up (idempotent), then run the main job: a local group of members
# feeding Spark and Delta. Extra arguments go to the job (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m zerocomm_spark.pipelines.main "$@"
