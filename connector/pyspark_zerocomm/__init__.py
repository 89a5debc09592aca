"""Auto-registration of format("zerocomm") in every Spark session, with no code in the notebook.

Spark 4.2 has no entry-point group for Python data sources; instead, the first time a session needs
one it imports every top-level module whose name starts with ``pyspark_`` and registers its
``DefaultSource`` (pyspark/sql/worker/lookup_data_sources.py). Installing zerocomm-spark installs
this module as top-level ``pyspark_zerocomm``, so ``spark.readStream.format("zerocomm")`` just works.
It imports only the provider (no ZeroMQ), because Spark imports it in a planner process.
"""

from zerocomm_spark.connector.provider import ZeroCommDataSource as DefaultSource

__all__ = ["DefaultSource"]
