#!/usr/bin/env bash
# One set-up path for the README's two commands and for CI: a virtual environment with the package
# installed, and the Delta Lake jars fetched once through Maven into a local cache so that every Spark
# session afterwards starts offline. Running it twice is fast and changes nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
venv="$root/.venv"
jars="${ZEROCOMM_JARS:-$HOME/.cache/zerocomm-spark/jars/delta-4.4.0-spark-4.2}"

say() { printf '[setup] %s\n' "$*" >&2; }

if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  # Missing, or left half-made by an interrupted run: make it anew.
  say "creating $venv with $($python --version)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
fi

# Reinstall only when the declared dependencies or the native extension's source changed.
stamp="$venv/.zerocomm-installed"
want="$(cat pyproject.toml setup.py zerocomm_spark/journal/_idrule.c | sha256sum | cut -d' ' -f1)"
# (and when a C compiler is here now but the optional extension was not built: none was before)
unbuilt() { command -v cc >/dev/null 2>&1 && ! compgen -G "zerocomm_spark/journal/_idrule*.so" >/dev/null; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || unbuilt; then
  say "installing zerocomm-spark and its pinned dependencies"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi

# Delta's jars: everything delta-spark needs at runtime that pyspark does not already ship.
if [ ! -f "$jars/.complete" ]; then
  command -v mvn >/dev/null || { say "Maven (mvn) is required to fetch the Delta Lake jars"; exit 1; }
  command -v java >/dev/null || { say "Java 17 is required by Spark"; exit 1; }
  say "fetching Delta Lake jars into $jars"
  tmp="$(mktemp -d)"
  mvn -q -B -f conf/maven/pom.xml dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$tmp" >&2
  sparkjars="$("$venv/bin/python" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"
  mkdir -p "$jars"
  for j in "$tmp"/*.jar; do
    name="$(basename "$j")"
    artifact="$(echo "$name" | sed -E 's/-[0-9][^-]*(-[0-9]+)?\.jar$//')"
    if ! compgen -G "$sparkjars/${artifact}-[0-9]*.jar" >/dev/null; then
      cp "$j" "$jars/"
    fi
  done
  rm -rf "$tmp"
  touch "$jars/.complete"
fi
echo "$jars" > "$venv/.zerocomm-jars"
