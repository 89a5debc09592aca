"""Runs one Agent in its own process, driven by JSON lines on stdin, answering JSON lines on stdout.

Used by test_agents.py so that every agent is a separate OS process with its own sockets, as in
production. One request per line: {"op": "...", ...}; one answer per line:
{"ok": true, "result": ...} or {"ok": false, "error": "<ZeroComm error class>", "message": "..."}.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any

from zerocomm_spark import Agent
from zerocomm_spark.protocols.message import ProtocolDescriptor


def _plain(value: Any) -> Any:
    if isinstance(value, ProtocolDescriptor):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    agent: Agent | None = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "open":
                agent = Agent.open(request.pop("path"), **request)
                result: Any = {"endpoint": agent.endpoint, "label": agent.label}
            elif op == "exit":
                if agent is not None and not agent.closed:
                    agent.close()
                print(json.dumps({"ok": True, "result": None}), flush=True)
                return 0
            else:
                assert agent is not None, "open first"
                result = _plain(getattr(agent, op)(**request))
            answer = {"ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            answer = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
