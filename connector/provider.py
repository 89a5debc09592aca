"""The data source named "zerocomm": schema, option validation, and which reader or writer to build.

Mirrors Spark's KafkaSourceProvider: it owns no state, validates options where Spark first shows
them to it (``load()`` for reads, ``start()``/``save()`` for writes), and hands out one class per
concern (micro-batch stream, batch reader, stream writer, batch writer).
"""

from __future__ import annotations

from typing import Literal

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from zerocomm_spark.errors import ConnectorOptionError, SinkSchemaError

from zerocomm_spark.connector.options import SinkOptions, SourceOptions
from zerocomm_spark.connector.schema import SinkColumns, sink_columns, source_schema

__all__ = ["NAME", "ZeroCommDataSource"]

NAME = "zerocomm"


class ZeroCommDataSource(DataSource):
    """``format("zerocomm")``: a secure group as a streaming (or batch) DataFrame, and back.

    Rows: group, message_id, publisher_did, publisher_label, seq, lamport_ts, sent_at, received_at,
    payload (+ headers with includeHeaders=true). Sort by (lamport_ts, publisher_did) for a total
    order that respects causality.
    """

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        # Spark calls this at load(): the place to refuse unknown or malformed options.
        return source_schema(SourceOptions.parse(self.options).include_headers)

    def _source_options(self, schema: StructType, mode: Literal["stream", "batch"]) -> SourceOptions:
        options = SourceOptions.parse(self.options, mode=mode)
        expected = source_schema(options.include_headers)
        if [(f.name, f.dataType) for f in schema.fields] != [(f.name, f.dataType) for f in expected.fields]:
            raise ConnectorOptionError(
                "format(\"zerocomm\") has a fixed schema; the schema given to the reader differs",
                hint=f"Drop .schema(...) (the source's schema is {expected.simpleString()}), "
                     "and use includeHeaders=true for the headers column")
        return options

    def reader(self, schema: StructType) -> DataSourceReader:
        from zerocomm_spark.connector.batch_reader import ZeroCommBatchReader

        return ZeroCommBatchReader(self._source_options(schema, "batch"), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from zerocomm_spark.connector.micro_batch_stream import ZeroCommMicroBatchStream

        return ZeroCommMicroBatchStream(self._source_options(schema, "stream"), schema)

    def _sink(self, schema: StructType, overwrite: bool, what: str) -> tuple[SinkOptions, SinkColumns]:
        from zerocomm_spark.connector.writer import check_sink_at_start

        options = SinkOptions.parse(self.options)
        if overwrite:
            raise SinkSchemaError(f"format(\"zerocomm\") {what} only appends messages to a group; it cannot "
                                  "overwrite or complete-rewrite what members already received",
                                  hint="Use mode('append') for writes and outputMode('append' or 'update') for "
                                       "streams")
        columns = sink_columns(schema)
        check_sink_at_start(options)
        return options, columns

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from zerocomm_spark.connector.writer import ZeroCommBatchWriter

        options, columns = self._sink(schema, overwrite, "df.write")
        return ZeroCommBatchWriter(options, columns)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from zerocomm_spark.connector.writer import ZeroCommStreamWriter

        options, columns = self._sink(schema, overwrite, "df.writeStream")
        return ZeroCommStreamWriter(options, columns)
