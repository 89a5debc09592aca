"""Pairwise connections: what a DID exchange leaves behind, persisted in the sealed keystore.

A record holds only public facts (DIDs, verkeys, endpoint, states); the private key of ``my_verkey``
stays in the keystore's key table. The store keeps an in-memory index because every inbound
message is matched to its connection by recipient key.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from zerocomm_spark.errors import ConnectionNotFoundError
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.message import utc_now

__all__ = ["Connection", "ConnectionRecord", "ConnectionStore", "RECORD_KIND"]

RECORD_KIND = "connection"

# RFC 0023 states, per role.
REQUESTER_STATES = ("invitation-received", "request-sent", "response-received", "completed", "abandoned")
RESPONDER_STATES = ("request-received", "response-sent", "completed", "abandoned")


@dataclass
class ConnectionRecord:
    """One relationship and where its DID exchange stands."""

    role: str  # "requester" (we accepted their invitation) or "responder" (they accepted ours)
    state: str
    connection_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    thread_id: str | None = None  # the DID-exchange request's @id
    invitation_id: str | None = None  # the pthid of the exchange
    invitation_key: str | None = None  # requester: their invitation key; responder: ours
    my_did: str | None = None
    my_verkey: str | None = None
    their_did: str | None = None
    their_verkey: str | None = None
    their_endpoint: str | None = None
    their_label: str | None = None
    problem: str | None = None  # why it was abandoned
    created_at: str = field(default_factory=utc_now)
    updated_at: str = field(default_factory=utc_now)

    @property
    def completed(self) -> bool:
        return self.state == "completed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConnectionRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def view(self) -> "Connection":
        return Connection(
            id=self.connection_id,
            label=self.their_label,
            their_did=self.their_did,
            my_did=self.my_did,
            state=self.state,
            role=self.role,
            endpoint=self.their_endpoint,
            created_at=self.created_at,
        )


@dataclass(frozen=True)
class Connection:
    """A read-only view of a connection for notebooks; pass it (or its id, DID, label) as ``peer``."""

    id: str
    label: str | None
    their_did: str | None
    my_did: str | None
    state: str
    role: str
    endpoint: str | None
    created_at: str

    @property
    def completed(self) -> bool:
        return self.state == "completed"

    def __repr__(self) -> str:  # DIDs are long; id, label and state are what a reader needs
        return f"Connection(id={self.id!r}, label={self.label!r}, state={self.state!r}, role={self.role!r})"


class ConnectionStore:
    """Connection records persisted through the keystore (kind ``connection``), with lookups."""

    def __init__(self, keystore: Keystore) -> None:
        self._keystore = keystore
        self._lock = threading.RLock()
        self._records: dict[str, ConnectionRecord] = {}
        for data in keystore.records(RECORD_KIND):
            record = ConnectionRecord.from_dict(data)
            self._records[record.connection_id] = record

    def save(self, record: ConnectionRecord) -> ConnectionRecord:
        """Persist ``record`` (durably, before returning) and index it."""
        with self._lock:
            record.updated_at = utc_now()
            self._keystore.put_record(RECORD_KIND, record.connection_id, record.to_dict())
            self._records[record.connection_id] = ConnectionRecord.from_dict(record.to_dict())
            return record

    def delete(self, connection_id: str) -> bool:
        with self._lock:
            self._records.pop(connection_id, None)
            return self._keystore.delete_record(RECORD_KIND, connection_id)

    @staticmethod
    def _clone(record: ConnectionRecord) -> ConnectionRecord:
        # Callers mutate and save(); handing out the indexed object would let a half-made change leak.
        return ConnectionRecord.from_dict(record.to_dict())

    def _copy(self, record: ConnectionRecord | None) -> ConnectionRecord | None:
        return None if record is None else self._clone(record)

    def get(self, connection_id: str) -> ConnectionRecord:
        with self._lock:
            record = self._copy(self._records.get(connection_id))
        if record is None:
            raise ConnectionNotFoundError(f"no connection with id {connection_id!r}")
        return record

    def find(self, connection_id: str) -> ConnectionRecord | None:
        with self._lock:
            return self._copy(self._records.get(connection_id))

    def _first(self, **match: Any) -> ConnectionRecord | None:
        with self._lock:
            for record in self._records.values():
                if all(getattr(record, k) == v for k, v in match.items()):
                    return self._copy(record)
        return None

    def by_their_did(self, did: str) -> ConnectionRecord | None:
        return self._first(their_did=did)

    def by_my_verkey(self, verkey: str) -> ConnectionRecord | None:
        return self._first(my_verkey=verkey)

    def by_thread_id(self, thread_id: str, role: str | None = None) -> ConnectionRecord | None:
        if role is None:
            return self._first(thread_id=thread_id)
        return self._first(thread_id=thread_id, role=role)

    def by_label(self, label: str) -> list[ConnectionRecord]:
        with self._lock:
            return [self._clone(r) for r in self._records.values() if r.their_label == label]

    def all(self) -> list[ConnectionRecord]:
        """Every connection, oldest first."""
        with self._lock:
            records = [self._clone(r) for r in self._records.values()]
        return sorted(records, key=lambda r: r.created_at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
