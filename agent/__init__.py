"""The long-running member process and the ``zerocomm`` command line.

``zerocomm agent start`` runs :class:`~zerocomm_spark.agent.process.AgentProcess`: one member with
its journal, serving the local API that :mod:`zerocomm_spark.client` (notebooks, Spark tasks) and
the command line use.
"""
