"""What a member must remember to rejoin its groups after a restart, kept in the sealed keystore.

A restarted member must come back *as itself*: the same member DID (its key is in the keystore),
the same transport key (so the others' CURVE allow-lists still admit it), the same publish endpoint
when the port can be bound again, its group keys, its view of each group, the connection it has
with each member, and how far it got in every publisher's stream (so it asks for exactly what it
missed). Everything is a keystore record, so it is sealed at rest like the connections.

Record kinds: ``zerocomm-group`` (one per group), ``zerocomm-group-positions`` (one per group,
written often, so kept apart from the view), ``zerocomm-group-seqs`` (one per group: how far our
sequence may have got, see ``seq_reserved``), ``zerocomm-group-identity`` (one), ``zerocomm-group-peer``
(member DID -> connection id, shared by all groups so a second group reuses the connections of the
first). The CURVE secret key is a keystore secret.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import zmq

from zerocomm_spark.errors import KeystoreError
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.message import utc_now

__all__ = ["GroupRecord", "GroupStore", "Identity", "Positions"]

GROUP_KIND = "zerocomm-group"
POSITIONS_KIND = "zerocomm-group-positions"
CLOCK_KIND = "zerocomm-group-clock"  # the Lamport clock's reservation: a restart starts the clock there
SEQS_KIND = "zerocomm-group-seqs"  # our seqs reserved ahead: after a crash, none at or below it is reused
LEFT_KIND = "zerocomm-group-left"  # our last seq in groups we left: kept, so a rejoin continues after it
IDENTITY_KIND = "zerocomm-group-identity"
PEER_KIND = "zerocomm-group-peer"
IDENTITY_ID = "self"
CURVE_SECRET = "zerocomm-group-curve-secret"
MEMBER_KEY_PURPOSE = "group-member"
GROUP_KEY_PURPOSE = "group"


@dataclass
class GroupRecord:
    """One group as this member holds it."""

    group: str
    mode: str
    ordered: bool
    consistent_join: bool
    role: str
    status: str  # ours: "joining" until the join completed, then "active"
    group_verkey: str  # our group key (the keystore holds its secret)
    invitation_url: str  # our multi-use invitation for members of this group
    invitation_id: str
    policy: dict[str, Any]
    view: list[dict[str, Any]] = field(default_factory=list)
    peers: dict[str, str] = field(default_factory=dict)  # member DID -> connection id, pub/sub relationships
    issued_invitations: list[str] = field(default_factory=list)  # invite(group) ids
    ticket: dict[str, Any] | None = None
    created_at: str = field(default_factory=utc_now)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GroupRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Positions:
    """Our last published seq and, per publisher, the last seq delivered to the application."""

    publish: int = 0
    receive: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Identity:
    """This member's group identity: the member key (its did:key) and the transport (CURVE) key pair."""

    member_verkey: str
    curve_public: bytes = field(repr=False)
    curve_secret: bytes = field(repr=False)
    publish_endpoint: str | None = None  # bound last time; bound again after a restart


class GroupStore:
    """Typed access to the group records of one keystore; thread-safe (the keystore is)."""

    def __init__(self, keystore: Keystore) -> None:
        self._keystore = keystore
        self._lock = threading.Lock()

    # --- identity --------------------------------------------------------------------------------

    def identity(self) -> Identity:
        """This member's identity, created (and persisted) on first use."""
        with self._lock:
            record = self._keystore.get_record(IDENTITY_KIND, IDENTITY_ID)
            secret = self._keystore.get_secret(CURVE_SECRET)
            if record is None or secret is None:
                key = self._keystore.create_key(MEMBER_KEY_PURPOSE, ref="zerocomm-group-member")
                public, secret = zmq.curve_keypair()
                self._keystore.put_secret(CURVE_SECRET, secret)
                record = {"member_verkey": key.verkey, "publish_endpoint": None}
                self._keystore.put_record(IDENTITY_KIND, IDENTITY_ID, record)
            if len(secret) != 40:
                raise KeystoreError("the stored CURVE transport key is damaged")
            public = zmq.curve_public(secret)
            endpoint = record.get("publish_endpoint")
            return Identity(record["member_verkey"], public, secret, endpoint if isinstance(endpoint, str) else None)

    def save_publish_endpoint(self, endpoint: str) -> None:
        with self._lock:
            record = self._keystore.get_record(IDENTITY_KIND, IDENTITY_ID) or {}
            if record.get("publish_endpoint") != endpoint:
                record["publish_endpoint"] = endpoint
                self._keystore.put_record(IDENTITY_KIND, IDENTITY_ID, record)

    # --- groups ----------------------------------------------------------------------------------

    def groups(self) -> list[GroupRecord]:
        return [GroupRecord.from_dict(d) for d in self._keystore.records(GROUP_KIND)]

    def get(self, group: str) -> GroupRecord | None:
        data = self._keystore.get_record(GROUP_KIND, group)
        return None if data is None else GroupRecord.from_dict(data)

    def save(self, record: GroupRecord) -> None:
        self._keystore.put_record(GROUP_KIND, record.group, record.to_dict())

    def delete(self, group: str) -> None:
        self._keystore.delete_record(GROUP_KIND, group)
        self._keystore.delete_record(POSITIONS_KIND, group)
        self._keystore.delete_record(SEQS_KIND, group)

    # --- positions -------------------------------------------------------------------------------

    def positions(self, group: str) -> Positions:
        data = self._keystore.get_record(POSITIONS_KIND, group) or {}
        publish = data.get("publish", 0)
        receive = data.get("receive", {})
        if not isinstance(publish, int) or not isinstance(receive, dict):
            return Positions()
        return Positions(publish, {k: v for k, v in receive.items() if isinstance(v, int) and v >= 0})

    def save_positions(self, group: str, positions: Positions) -> None:
        self._keystore.put_record(POSITIONS_KIND, group, {"publish": positions.publish,
                                                          "receive": dict(positions.receive)})

    def seq_reserved(self, group: str) -> int:
        """The highest seq we may have published in ``group`` (0 if none saved): saved before any seq
        past it is used, and exactly at a clean close. The positions record lags it (written every
        ``persist_interval_s``), so after a crash only this bounds what members may hold of our stream."""
        data = self._keystore.get_record(SEQS_KIND, group) or {}
        value = data.get("reserved", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    def save_seq_reserved(self, group: str, value: int) -> None:
        self._keystore.put_record(SEQS_KIND, group, {"reserved": int(value)})

    def left_position(self, group: str) -> int:
        """Our highest seq in ``group`` when we last left it (0 if never): a new sequence must start
        after it, or members (and their journals) that kept our stream take new messages for old ones."""
        data = self._keystore.get_record(LEFT_KIND, group) or {}
        publish = data.get("publish", 0)
        return publish if isinstance(publish, int) and not isinstance(publish, bool) and publish > 0 else 0

    def save_left_position(self, group: str, publish: int) -> None:
        """Remember ``publish`` (never lowering it): ``delete`` keeps this record."""
        with self._lock:
            if publish > self.left_position(group):
                self._keystore.put_record(LEFT_KIND, group, {"publish": publish})

    # --- Lamport clock ---------------------------------------------------------------------------

    def clock_reserved(self) -> int:
        """The last limit the member's Lamport clock reserved (0 if none): a restart starts there."""
        data = self._keystore.get_record(CLOCK_KIND, IDENTITY_ID) or {}
        value = data.get("reserved", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    def save_clock_reserved(self, value: int) -> None:
        self._keystore.put_record(CLOCK_KIND, IDENTITY_ID, {"reserved": int(value)})

    # --- peers -----------------------------------------------------------------------------------

    def peer_connection(self, member_did: str) -> str | None:
        """The connection we last used with this member DID, in any group."""
        data = self._keystore.get_record(PEER_KIND, member_did)
        value = data.get("connection_id") if data else None
        return value if isinstance(value, str) else None

    def save_peer(self, member_did: str, connection_id: str) -> None:
        if self.peer_connection(member_did) != connection_id:
            self._keystore.put_record(PEER_KIND, member_did, {"connection_id": connection_id})
