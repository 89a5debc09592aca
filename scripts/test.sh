#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite with real sockets,
# processes, Spark and Delta. Extra arguments go to pytest, which then runs exactly what they say.
#
# With no arguments the Spark tests (tests/spark: one Spark session, JVM start-ups, Delta commits)
# run in a second pytest beside the rest, so the two halves overlap instead of following each other
# (about 35 and 20 minutes alone on 2 vCPUs). Their report follows the rest's; the exit status is
# the first failing one's. ZEROCOMM_TEST_SERIAL=1 runs everything in one pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
pytest=("$root/.venv/bin/python" -m pytest -p no:cacheprovider -q)
if [ "$#" -gt 0 ] || [ "${ZEROCOMM_TEST_SERIAL:-0}" = 1 ]; then
  exec "${pytest[@]}" "$@"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/zerocomm-tests.XXXXXX")"
spark_pid=""
cleanup() {
  if [ -n "$spark_pid" ]; then kill -TERM "$spark_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Each pytest gets its own base temporary directory: two sessions must not prune each other's.
# --durations: each half's slowest tests in its report, to balance the halves by (CI's limit is on the total).
"${pytest[@]}" --durations=20 --basetemp "$work/spark" tests/spark >"$work/spark.log" 2>&1 &
spark_pid=$!
echo "[tests] tests/spark runs beside the rest (pid $spark_pid); its report follows at the end" >&2
set +e
"${pytest[@]}" --durations=20 --basetemp "$work/rest" tests --ignore tests/spark
rest=$?
wait "$spark_pid"
spark=$?
set -e
spark_pid=""
echo
echo "=== tests/spark (run beside the rest above) ==="
cat "$work/spark.log"
if [ "$rest" -ne 0 ]; then exit "$rest"; fi
exit "$spark"
