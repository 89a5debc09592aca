"""A member's view of a group: who is in it, how to reach them, and how views are compared and merged.

Why it is built this way (docs/groups.md, "Membership"; thesis 4.4, 5.3.3, 7.2):

* **Entries are self-certified.** Each member's entry (label, role, status, endpoints, keys, its
  multi-use group invitation, a version) is signed by the member's own key, the one its ``did:key``
  names. A view is therefore a set of signed statements: a byzantine member can add an intruder
  (a real, self-signed entry) but cannot alter or invent another member's entry, roll its version
  back or mark it as left. Only the owner changes its entry, so merging is last-writer-wins by
  version and needs no coordination.
* **Versions are hybrid clocks** (``max(previous + 1, now in ms)``): a member that crashed and lost
  its last version still announces a higher one afterwards.
* **The checksum is about membership, not weather**: it covers the DID and keys of every member
  that is in the group (status ``active``), not roles, labels, endpoints or the local
  keepalive-driven *inactive* marking, so two honest members agree on it whenever they agree on
  who is in the group, which is what a joiner must verify (thesis 7.2).
* **Status messages** are one message with a sub-section per member, each packed (RFC 0019
  authcrypt) for that member and keyed by the exchange id the two share, then zstd-compressed
  (thesis 4.4 option 4, 5.3.3). Applying one twice changes nothing: entries merge by version.
"""

from __future__ import annotations

import hashlib
import io
import logging
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Any

import zstandard

from zerocomm_spark.did.peer import did_key, verkey_from_did_key
from zerocomm_spark.envelope import pack, unpack
from zerocomm_spark.errors import DIDError, EnvelopeError, MalformedGroupMessageError, SignatureError
from zerocomm_spark.group.topics import check_group
from zerocomm_spark.keys.keypair import KeyPair, verify_signature, verkey_to_x25519
from zerocomm_spark.protocols.message import b64url_decode, b64url_encode
from zerocomm_spark.text import is_utf8_text
from zerocomm_spark.transport.peer import connectable

__all__ = [
    "ACTIVE",
    "JOINING",
    "LEFT",
    "INACTIVE",
    "STATUSES",
    "GroupView",
    "MemberEntry",
    "StatusSection",
    "member_did_for",
    "next_version",
    "open_status",
    "seal_status",
]

JOINING = "joining"  # subscribed to some members, not yet verified and announced
ACTIVE = "active"  # announced itself: a member of the group
INACTIVE = "inactive"  # never announced; shown when keepalives to an active member fail
LEFT = "left"  # left gracefully (a tombstone, so repair does not resurrect it)
STATUSES = (JOINING, ACTIVE, LEFT)
ROLES = ("read_write", "read_only")

STATUS_TYPE = "https://didcomm.org/zerocomm-group/1.0/status"
SECTIONS_TYPE = "https://didcomm.org/zerocomm-group/1.0/status-sections"
MAX_STATUS_BYTES = 16 * 1024 * 1024  # decompressed; bounds a hostile zstd bomb
_MAX_STATUS_RATIO = 8  # decompressed bytes per compressed byte: honest statuses stay under 2
_STATUS_SLACK = 64 * 1024
MAX_SECTIONS = 10_000
MAX_ENTRIES = 10_000
_MAX_FIELD = 8192


def next_version(previous: int = 0) -> int:
    """A version greater than ``previous`` and than any this member announced before a crash."""
    return max(previous + 1, time.time_ns() // 1_000_000)


def member_did_for(verkey: str) -> str:
    """The member DID of a member key: a did:key, short (it rides in topics and batches) and self-certifying."""
    return did_key(verkey)


log = logging.getLogger(__name__)


@lru_cache(maxsize=4096)
def _verkey_of(did: str) -> str:
    return verkey_from_did_key(did)


def _field_str(data: Mapping[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = data.get(name)
    if not isinstance(value, str) or (not value and not allow_empty) or len(value) > _MAX_FIELD:
        raise MalformedGroupMessageError(f"member entry field '{name}' must be a string of at most {_MAX_FIELD} characters")
    if not is_utf8_text(value):  # a lone surrogate: the entry could not be signed or hashed
        raise MalformedGroupMessageError(f"member entry field '{name}' holds a lone surrogate (\\ud800-\\udfff), not text")
    return value


def _storable(value: Any) -> bool:
    """Small, UTF-8 text and finite numbers only: the entry lands in the group's keystore record,
    which refuses NaN/Infinity, so one held in a view failed every later save of the group."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return len(text.encode("utf-8")) <= _MAX_FIELD
    except (ValueError, TypeError, UnicodeEncodeError, RecursionError):  # NaN/inf, a non-JSON value, a lone surrogate
        return False


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _usable_verkey(verkey: str) -> bool:
    """Can others encrypt to this key (base58, 32 bytes, a point with an X25519 form)?"""
    return len(verkey) <= 48 and _usable_short_verkey(verkey)  # base58 of 32 bytes is 43-44 characters


@lru_cache(maxsize=16384)  # views are re-parsed often and their keys rarely change
def _usable_short_verkey(verkey: str) -> bool:
    try:
        verkey_to_x25519(verkey)
    except (DIDError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class MemberEntry:
    """One member as it announced itself; ``signature`` is its member key over every other field."""

    did: str
    label: str
    role: str
    status: str
    peer_endpoint: str
    publish_endpoint: str
    group_verkey: str
    transport_key: str
    invitation: str
    version: int
    ticket: dict[str, Any] | None = None  # who admitted it (policy.Ticket), so others can check second-hand news
    # The group it is an entry of, under the signature: a member has one DID and member key for all
    # its groups, so an entry not naming its group was valid in every one of them (a member's "left"
    # in one group, replayed by another member, removed it from the others).
    group: str = ""
    signature: str = ""

    def __repr__(self) -> str:  # keys and invitations are long and not for logs
        return f"MemberEntry(did={self.did!r}, label={self.label!r}, role={self.role!r}, status={self.status!r}, version={self.version})"

    def _signed_part(self) -> bytes:
        data = asdict(self)
        data.pop("signature")
        return _canonical(data)

    def signed(self, member_key: KeyPair) -> "MemberEntry":
        """This entry signed by its owner (``member_key`` must be the key ``did`` names)."""
        if member_did_for(member_key.verkey) != self.did:
            raise SignatureError("a member entry is signed by the key its DID names, and only by it")
        return replace(self, signature=b64url_encode(member_key.sign(self._signed_part())))

    def verify(self, group: str | None = None) -> "MemberEntry":
        """Self, if the signature is the DID owner's (and, given ``group``, the entry is of that group);
        SignatureError otherwise."""
        if not self.signature:
            raise SignatureError(f"the entry of {self.did} is not signed")
        if group is not None and self.group != group:
            raise SignatureError(f"the entry of {self.did} is not of this group (an entry of another group, replayed)")
        try:
            verkey = _verkey_of(self.did)
            signature = b64url_decode(self.signature)
        except (DIDError, ValueError):
            raise SignatureError(f"the entry of {self.did} has an unreadable DID or signature") from None
        verify_signature(verkey, self._signed_part(), signature)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "MemberEntry":
        """Parse and check the shape (not the signature: call ``verify``)."""
        if not isinstance(data, Mapping):
            raise MalformedGroupMessageError("a member entry must be a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "version":
                version = data.get("version")
                if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
                    raise MalformedGroupMessageError("member entry field 'version' must be a non-negative integer")
                values["version"] = version
            elif f.name == "group":
                values["group"] = _field_str(data, "group", allow_empty=True) if "group" in data else ""
            elif f.name == "ticket":
                ticket = data.get("ticket")
                if ticket is not None and (not isinstance(ticket, Mapping) or not _storable(ticket)):
                    raise MalformedGroupMessageError(
                        "member entry field 'ticket' must be a small JSON object of text and finite numbers")
                values["ticket"] = dict(ticket) if ticket is not None else None
            else:
                values[f.name] = _field_str(data, f.name, allow_empty=f.name in ("signature", "label"))
        if values["role"] not in ROLES:
            raise MalformedGroupMessageError("member entry field 'role' must be read_write or read_only")
        if values["status"] not in STATUSES:
            raise MalformedGroupMessageError(f"member entry field 'status' must be one of {', '.join(STATUSES)}")
        if not values["did"].startswith("did:key:"):
            raise MalformedGroupMessageError("member entry field 'did' must be a did:key")
        # Keys others will encrypt to: one unusable key in a shared-mode group would fail every
        # batch sealed for all members at once, so it is refused here, where the entry comes in.
        if not _usable_verkey(values["group_verkey"]):
            raise MalformedGroupMessageError("member entry field 'group_verkey' must be a base58 Ed25519 public key") from None
        # Endpoints the data plane connects a socket to: one connect() refuses (tcp://x) raised ZMQError
        # out of the handler, after the member's old subscription was already dropped.
        for name in ("peer_endpoint", "publish_endpoint"):
            if not connectable(values[name]):
                raise MalformedGroupMessageError(f"member entry field '{name}' must be an endpoint like tcp://host:port")
        transport_key = values["transport_key"]
        if len(transport_key) != 40 or not transport_key.isascii():
            raise MalformedGroupMessageError("member entry field 'transport_key' must be a 40-character Z85 CURVE key")
        return cls(**values)

    def content_key(self) -> tuple[int, bytes]:
        """Total order used to merge: higher version wins, ties broken deterministically."""
        return self.version, _canonical(asdict(self))


def parse_entries(raw: Any, *, group: str | None = None, verify: bool = True,
                  skip_invalid: bool = False) -> list[MemberEntry]:
    """Entries from a peer: shape-checked and, by default, signature-checked (as entries of ``group``).

    ``skip_invalid`` drops (and logs) the entries that fail instead of refusing the whole list: for
    views, where one entry an older version accepted (a saved view, a peer's repair answer) must not
    cost every other member.
    """
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise MalformedGroupMessageError(f"a view is a list of at most {MAX_ENTRIES} member entries")
    entries = []
    for item in raw:
        try:
            entry = MemberEntry.from_dict(item)
            if verify:
                entry.verify(group)
        except (MalformedGroupMessageError, SignatureError) as exc:
            if not skip_invalid:
                raise
            log.warning("skipped a member entry of a view: %s", str(exc).split(". ")[0][:200])
            continue
        entries.append(entry)
    return entries


class GroupView:
    """The entries one member holds for one group; not thread-safe (the manager holds its lock)."""

    def __init__(self, group: str, entries: Iterable[MemberEntry] = ()) -> None:
        self.group = check_group(group)
        self._entries: dict[str, MemberEntry] = {}
        for entry in entries:
            self.merge(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, did: object) -> bool:
        return did in self._entries

    def __repr__(self) -> str:
        return f"GroupView({self.group!r}, {len(self._entries)} entries, checksum={self.checksum()[:12]})"

    def get(self, did: str) -> MemberEntry | None:
        return self._entries.get(did)

    def entries(self) -> list[MemberEntry]:
        """Every entry (left members too), sorted by DID."""
        return [self._entries[d] for d in sorted(self._entries)]

    def members(self, statuses: Iterable[str] = (ACTIVE,)) -> list[MemberEntry]:
        wanted = set(statuses)
        return [e for e in self.entries() if e.status in wanted]

    def versions(self) -> dict[str, int]:
        return {did: e.version for did, e in self._entries.items()}

    def merge(self, entry: MemberEntry) -> MemberEntry | None:
        """Adopt ``entry`` if it is newer than ours; returns the entry it replaced (or itself if new), None if unchanged.

        Callers verify signatures first (``parse_entries``); merging is idempotent and commutative.
        """
        current = self._entries.get(entry.did)
        if current is not None and current.content_key() >= entry.content_key():
            return None
        self._entries[entry.did] = entry
        return current if current is not None else entry

    def remove(self, did: str) -> MemberEntry | None:
        """Forget an entry locally (a joiner that never finished); repair may bring it back."""
        return self._entries.pop(did, None)

    def checksum(self) -> str:
        """SHA-256 over the group name and the (DID, group key, transport key) of every active member.

        Identical for every member that agrees on who is in the group (thesis 7.2), whatever the
        order it learned them in; excludes joiners, leavers, roles and endpoints.
        """
        members = [[e.did, e.group_verkey, e.transport_key] for e in self.members((ACTIVE,))]
        return hashlib.sha256(_canonical({"group": self.group, "members": members})).hexdigest()

    def state_hash(self) -> str:
        """SHA-256 over every entry with its version: equal hashes mean nothing to repair."""
        return hashlib.sha256(_canonical([[e.did, e.version] for e in self.entries()])).hexdigest()

    def newer_than(self, versions: Mapping[str, int]) -> list[MemberEntry]:
        """Our entries the holder of ``versions`` lacks or has older: what to send it."""
        return [e for e in self.entries() if versions.get(e.did, -1) < e.version]

    def wanted_from(self, versions: Mapping[str, int]) -> list[str]:
        """DIDs the holder of ``versions`` has newer than us: what to pull from it."""
        out = []
        for did, version in versions.items():
            ours = self._entries.get(did)
            if ours is None or ours.version < version:
                out.append(did)
        return sorted(out)

    def to_list(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.entries()]


# --- status messages: one message, a section per member ----------------------------------------


@dataclass(frozen=True)
class StatusSection:
    """Who a section is for: the exchange id we share with the member and the keys of that relationship."""

    exchange_id: str
    their_verkey: str
    my_key: KeyPair


def _zstd_bounded(blob: bytes) -> bytes:
    """Decompressed, bounded by MAX_STATUS_BYTES and by ``_MAX_STATUS_RATIO`` times the blob: a status
    is mostly ciphertext (a sealed section per member), which zstd shrinks by ~1.6 at most (measured
    1.3 for one section, 1.6 for 300). A 578-byte frame inflating to 16 MiB (~75 ms to open, ~28,000
    times its size) is a bomb a member could send hundreds of times a second."""
    limit = min(MAX_STATUS_BYTES, _MAX_STATUS_RATIO * len(blob) + _STATUS_SLACK)
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob))
    data = reader.read(limit + 1)
    if len(data) > limit:
        raise MalformedGroupMessageError(f"a status message of {len(blob)} bytes decompresses to more than "
                                         f"{limit} bytes")
    return data


def seal_status(group: str, sender_did: str, entries: Iterable[MemberEntry],
                sections: Iterable[StatusSection], *, level: int = 3) -> bytes:
    """One status message for ``sections``' members: each packed for one member, keyed by exchange id, zstd'd."""
    body = {
        "@type": STATUS_TYPE,
        "@id": str(uuid.uuid4()),
        "group": group,
        "sender": sender_did,
        "entries": [e.to_dict() for e in entries],
    }
    plaintext = _canonical(body)
    packed: dict[str, Any] = {}
    for section in sections:
        env = pack(plaintext, [section.their_verkey], sender=section.my_key)
        packed[section.exchange_id] = json.loads(env)
    outer = {"@type": SECTIONS_TYPE, "@id": body["@id"], "group": group, "sections": packed}
    return zstandard.ZstdCompressor(level=level).compress(_canonical(outer))


@dataclass(frozen=True)
class OpenedStatus:
    """The section of a status message that was for us, authenticated."""

    exchange_id: str
    sender_verkey: str
    sender_did: str
    entries: list[MemberEntry]


def open_status(group: str, blob: bytes, mine: Mapping[str, str],
                lookup: Callable[[str], KeyPair | None]) -> OpenedStatus | None:
    """Our section of a status message, or None if it has none for us.

    ``mine`` maps each exchange id we share with a member of ``group`` to that member's verkey in
    the relationship; the section must be authcrypted by exactly that key. Raises
    MalformedGroupMessageError / EnvelopeError / SignatureError on anything forged or broken.
    """
    try:
        outer = json.loads(_zstd_bounded(blob))
    except zstandard.ZstdError:
        raise MalformedGroupMessageError("a status message is not zstd-compressed") from None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested a few thousand deep
        raise MalformedGroupMessageError("a status message is not JSON") from None
    if not isinstance(outer, dict) or outer.get("@type") != SECTIONS_TYPE or outer.get("group") != group:
        raise MalformedGroupMessageError("a status message has the wrong type or group")
    sections = outer.get("sections")
    if not isinstance(sections, dict) or len(sections) > MAX_SECTIONS:
        raise MalformedGroupMessageError("field 'sections' of a status message must be an object")
    for exchange_id, their_verkey in mine.items():
        section = sections.get(exchange_id)
        if section is None:
            continue
        try:
            envelope = _canonical(section)
        except UnicodeEncodeError:
            raise MalformedGroupMessageError("a status section holds a lone surrogate, not an envelope") from None
        unpacked = unpack(envelope, lookup)
        if unpacked.sender_verkey != their_verkey:
            raise EnvelopeError("a status section was not packed by the member its exchange id belongs to")
        try:
            body = json.loads(unpacked.message)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise MalformedGroupMessageError("a status section is not JSON") from None
        if not isinstance(body, dict) or body.get("@type") != STATUS_TYPE or body.get("group") != group:
            raise MalformedGroupMessageError("a status section has the wrong type or group")
        if body.get("@id") != outer.get("@id"):
            raise MalformedGroupMessageError("a status section was moved from another status message")
        sender = body.get("sender")
        if not isinstance(sender, str) or not sender.startswith("did:key:"):
            raise MalformedGroupMessageError("field 'sender' of a status section must be a did:key")
        return OpenedStatus(exchange_id, their_verkey, sender, parse_entries(body.get("entries"), group=group))
    return None
