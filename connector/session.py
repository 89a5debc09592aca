"""A local Spark session with Delta Lake, started offline from the jars set-up cached.

Why a helper: ``configure_spark_with_delta_pip`` resolves jars from the network on every start; we
fetch them once with Maven (scripts/setup.sh) and point ``spark.jars`` at the cache, so sessions
start without a network, and the Python workers run the interpreter that runs us.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zerocomm_spark.errors import ConfigurationError

DELTA_VERSION = "4.4.0"
_DEFAULT_JARS = Path.home() / ".cache" / "zerocomm-spark" / "jars" / "delta-4.4.0-spark-4.2"


def delta_jars_dir() -> Path:
    """Where set-up cached Delta's jars: $ZEROCOMM_JARS, the venv's note, or the default cache."""
    env = os.environ.get("ZEROCOMM_JARS")
    if env:
        return Path(env)
    note = Path(sys.prefix) / ".zerocomm-jars"
    if note.is_file():
        return Path(note.read_text().strip())
    return _DEFAULT_JARS


def delta_jars() -> list[str]:
    directory = delta_jars_dir()
    jars = sorted(str(p) for p in directory.glob("*.jar"))
    if not any("delta-spark" in Path(j).name for j in jars):
        raise ConfigurationError(
            f"the Delta Lake jars are not in {directory}",
            hint="Run scripts/setup.sh once (it fetches them with Maven), or set ZEROCOMM_JARS",
        )
    return jars


def local_spark(
    app_name: str = "zerocomm-spark",
    *,
    master: str = "local[2]",
    conf: dict[str, str] | None = None,
):
    """Build (or return the running) local SparkSession with Delta and format("zerocomm") configured.

    Spark binds to loopback only; the worker Python is this interpreter so executors import the
    same zerocomm_spark as the driver.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = {
        "spark.jars": ",".join(delta_jars()),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.driver.extraJavaOptions": "-Dderby.system.home=" + str(Path.cwd() / ".cache" / "derby"),
    }
    settings.update(conf or {})
    builder = SparkSession.builder.appName(app_name).master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    # An editable install cannot expose the top-level pyspark_zerocomm module Spark's own lookup
    # finds, so register format("zerocomm") here too; it is idempotent.
    from zerocomm_spark.connector import register

    register(spark)
    return spark
