"""Runs one Agent with its groups in its own process, driven by JSON lines on stdin (test_groups.py).

One request per line: {"op": "...", ...}; one answer per line: {"ok": true, "result": ...} or
{"ok": false, "error": "<ZeroComm error class>", "message": "..."}. Ops: ``open``, ``exit``, any
Agent method (``invite``, ``accept``), ``groups`` (a GroupManager method: {"method", "args"}),
``collect`` (receive n messages of a group), ``entry`` and ``inject`` (the byzantine test's hooks:
read our own signed view entry, put someone else's into our view).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from typing import Any

from zerocomm_spark import Agent
from zerocomm_spark.group.dataplane import DataPlaneConfig, Delivered
from zerocomm_spark.group.manager import GroupConfig
from zerocomm_spark.group.policy import policy_from_dict
from zerocomm_spark.group.view import MemberEntry


def _plain(value: Any) -> Any:
    if isinstance(value, Delivered):
        return {"publisher": value.publisher_did, "seq": value.seq, "lamport": value.lamport_ts,
                "id": value.message_id, "payload": value.payload.decode("utf-8")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _config(data: dict[str, Any] | None) -> GroupConfig | None:
    if data is None:
        return None
    data = dict(data)
    plane = DataPlaneConfig(**data.pop("dataplane", {}))
    return GroupConfig(dataplane=plane, **data)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")
    agent: Agent | None = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "open":
                config = _config(request.pop("group_config", None))
                agent = Agent.open(request.pop("path"), group_config=config, **request)
                result: Any = {"endpoint": agent.endpoint, "label": agent.label, "did": agent.groups.did}
            elif op == "exit":
                if agent is not None and not agent.closed:
                    agent.close()
                print(json.dumps({"ok": True, "result": None}), flush=True)
                return 0
            elif op == "groups":
                assert agent is not None, "open first"
                args = request.get("args", {})
                if "policy" in args:
                    args["policy"] = policy_from_dict(args["policy"])
                if request["method"] == "publish":
                    receipt = agent.groups.publish(**args)
                    if request.get("wait"):
                        receipt.wait(request["wait"])
                    result = {"seqs": list(receipt.seqs), "lamport": list(receipt.lamport_ts)}
                else:
                    result = _plain(getattr(agent.groups, request["method"])(**args))
            elif op == "collect":  # n messages of a group, in delivery order
                assert agent is not None, "open first"
                deadline = time.monotonic() + request["within"]
                got = []
                while len(got) < request["n"]:
                    got.append(_plain(agent.groups.receive(request["group"], max(deadline - time.monotonic(), 0.01))))
                result = got
            elif op == "entry":
                assert agent is not None, "open first"
                g = agent.groups._groups[request["group"]]  # noqa: SLF001 - test hook
                result = g.view.get(agent.groups.did).to_dict()
            elif op == "inject":  # a byzantine member: someone else's (genuine) entry in our view
                assert agent is not None, "open first"
                g = agent.groups._groups[request["group"]]  # noqa: SLF001 - test hook
                g.view.merge(MemberEntry.from_dict(request["entry"]).verify())
                result = g.view.checksum()
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
