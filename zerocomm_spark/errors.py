"""One exception hierarchy for the whole project.

Every error a user can meet derives from :class:`ZeroCommError`, is named for what went wrong and
says what to do next. Messages never carry key material or plaintext payloads.
"""

from __future__ import annotations


class ZeroCommError(Exception):
    """Root of every error raised by zerocomm-spark."""

    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint if hint is not None else self.hint
        super().__init__(f"{message}. {self.hint}" if self.hint else message)

    @property
    def message(self) -> str:
        """What went wrong without the hint (``str()`` says both), for those who show the two apart."""
        text = str(self)
        return text[: -len(self.hint) - 2] if self.hint and text.endswith(f". {self.hint}") else text


# --- configuration and usage -------------------------------------------------------------------


class ConfigurationError(ZeroCommError):
    """A setting, option or argument is missing or malformed."""

    hint = "Check the named setting against conf/zerocomm.toml and the README."


class OwnInvitationError(ConfigurationError):
    """The invitation being accepted was made by this very member (pasted into the inviter's terminal)."""

    hint = ("Accept it on the other member (`zerocomm connect URL` there, or other_agent.accept(url)); a member "
            "does not connect to itself")


class InvalidTimeoutError(ConfigurationError, ValueError):
    """A timeout is not a finite number of seconds: every wait has a deadline."""

    hint = "Give a finite number of seconds; to wait longer, wait again when it passes (nothing is lost meanwhile)."


# --- keys and identities -----------------------------------------------------------------------


class IdentityNotFoundError(ConfigurationError):
    """No identity in the directory an agent started on demand would serve: a spawn never creates one
    (a typo in a path would otherwise make a new member, silently, and leave its agent running)."""

    hint = ("Create it with `zerocomm init --identity-dir DIR`, or point at an existing one (--config or "
            "--identity-dir; the connector's `agent` option or ZEROCOMM_CONFIG)")


class KeystoreError(ZeroCommError):
    """The sealed keystore cannot be opened or written."""

    hint = "Check the identity directory's permissions and the passphrase."


class IdentityPathError(KeystoreError, ConfigurationError):
    """The identity directory's path is a file, or goes through one: a mistake in the path given (a
    usage error), not a keystore's permissions or passphrase."""

    hint = "Give identity.dir (--identity-dir) a directory, or a path that does not exist yet (it is created)"


class KeystoreLockedError(KeystoreError):
    """The keystore could not be unsealed: wrong passphrase or key file, or a damaged file."""

    hint = "Give the passphrase (or key file) the keystore was created with; keys are never printed."


class KeyNotFoundError(KeystoreError):
    """No key pair for the verkey asked for is held by this member."""

    hint = "The message or connection names a key this member never created; check the identity directory."


class InsecurePermissionsError(KeystoreError):
    """The identity directory or key file can be read or written by other users."""

    hint = "Keep the identity directory mode 700 and its key file mode 600, owned by the user running the agent."


class KeystoreClosedError(KeystoreError):
    """The keystore was used after close()."""

    hint = "Open it again with Keystore.open(directory)."


class InvalidRecordError(KeystoreError):
    """A record, secret or name given to the keystore cannot be stored."""

    hint = "Names are non-empty strings, secrets bytes, records JSON objects (str keys, JSON values)."


class DIDError(ZeroCommError):
    """A DID is malformed or cannot be resolved."""

    hint = "Use a did:peer:2 DID produced by a ZeroComm or Aries agent."


class SignatureError(ZeroCommError):
    """A signature does not verify against the key that should have made it."""

    hint = "The data was altered or signed by someone else; discard it and ask the sender again."


# --- envelopes (RFC 0019) ----------------------------------------------------------------------


class EnvelopeError(ZeroCommError):
    """An envelope cannot be packed or unpacked."""

    hint = "Check that the sender packed an Aries RFC 0019 (DIDComm v1) envelope."


class MalformedEnvelopeError(EnvelopeError):
    """The envelope is not valid JSON or misses fields RFC 0019 requires (truncated or foreign)."""

    hint = "The bytes are not an RFC 0019 envelope or were cut short; ask the sender to resend."


class NoRecipientKeyError(EnvelopeError):
    """The envelope is addressed to no key this member holds."""

    hint = "The envelope is for someone else; check the connection it arrived on."


class TamperedEnvelopeError(EnvelopeError):
    """A field of the envelope was altered: authentication failed, nothing was decrypted."""

    hint = "Discard the message; it was modified in transit or packed with other keys."


# --- transport ---------------------------------------------------------------------------------


class TransportError(ZeroCommError):
    """The peer transport failed."""

    hint = "Check that the peer's endpoint is reachable on this host or network."


class FrameError(TransportError):
    """A wire frame cannot be parsed."""

    hint = "The peer speaks another protocol or sent a damaged frame; it has been answered with an Error."


class FrameTooLargeError(FrameError):
    """A frame is bigger than the configured limit."""

    hint = "Send smaller messages or raise peer.max_frame_bytes on both members."


class PeerTimeoutError(TransportError):
    """A peer did not answer within the deadline."""

    hint = "The peer may be down or overloaded; retry later or raise the timeout."


class PeerUnreachableError(TransportError):
    """The peer cannot be reached at its endpoint."""

    hint = "Check that the peer's agent is running and its endpoint is correct."


class RemoteError(TransportError):
    """The peer answered with an Error frame (it could not parse or does not support the request)."""

    hint = "Check that both members run compatible zerocomm-spark versions."


class RemoteNotSupportedError(RemoteError):
    """The peer serves no handler for the protocol id (or message type) that was sent to it."""

    hint = "The peer does not serve this protocol; check its discover-features answer or its version."


class RemoteHandlerError(RemoteError):
    """The peer's handler raised while answering the request; the peer logged the details."""

    hint = "The failure is on the peer's side; see its log, then retry."


class RemoteFrameTooLargeError(RemoteError):
    """The peer refused the frame because it exceeds the peer's max_frame_bytes."""

    hint = "Send smaller messages or raise peer.max_frame_bytes on both members."


class FrameFieldError(TransportError, ValueError):
    """A wire header field is out of range, so the message cannot be encoded."""

    hint = "Protocol ids and priorities are 0-255, request ids and nonces 0 to 2**32-1, payloads bytes."


class TransportNotRunningError(TransportError):
    """The transport was used before start() or after close(), or closed while a call was pending."""

    hint = "Call start() (or use the transport as a context manager); a closed transport cannot restart."


# --- DIDComm protocols -------------------------------------------------------------------------


class ProtocolError(ZeroCommError):
    """A DIDComm protocol message is invalid or arrives in the wrong state."""

    hint = "The peer may run an incompatible protocol version; see its discover-features answer."


class InvitationError(ProtocolError):
    """An out-of-band invitation is malformed, unknown, or already used."""

    hint = "Ask the inviter for a fresh invitation URL."


class ConnectionNotFoundError(ProtocolError):
    """No connection with the named peer exists."""

    hint = ("Accept an invitation from that peer first (agent.accept(url), or `zerocomm connect URL`) or check the "
            "peer's id, label or DID (agent.connections(), or `zerocomm connections`).")


class ReplayError(ProtocolError):
    """A protocol message was seen before and was not processed again."""

    hint = "Nothing to do: the duplicate was ignored."


class UnknownMessageTypeError(ProtocolError):
    """The message's @type names a protocol or message this agent does not implement."""

    hint = "Ask the peer which protocols it speaks with agent.discover(peer, '*')."


class ConnectionNotReadyError(ProtocolError):
    """The connection exists but its DID exchange has not completed (or was abandoned)."""

    hint = "Wait for the DID exchange to complete, or accept a fresh invitation if it was abandoned."


class ProblemReportError(ProtocolError):
    """The peer answered with a DIDComm problem report instead of continuing the protocol."""

    hint = "See the report's code; usually ask the peer for a fresh invitation and try again."


class InboxFullError(ProtocolError):
    """The peer's agent holds as many basic messages not yet received as it keeps; this one was refused."""

    hint = "Nothing was delivered; send it again once the peer's application has received (agent.receive()) some."


class ReceiveTimeoutError(ZeroCommError, TimeoutError):
    """No message arrived within the deadline given to receive()."""

    hint = "Nothing was lost; call receive() again or give a longer timeout."


class AgentClosedError(ZeroCommError):
    """The agent was used after close()."""

    hint = "Open the agent again with Agent.open(path)."


class AgentAlreadyRunningError(ZeroCommError):
    """Another agent already holds this identity directory."""

    hint = "Stop the other agent or use another identity directory."


# --- groups: data plane ------------------------------------------------------------------------


class GroupError(ZeroCommError):
    """A group operation failed."""

    hint = "Check the group's name and this member's view of it (members(group))."


class InvalidGroupNameError(GroupError, ValueError):
    """A group name cannot be used in topic names."""

    hint = "Use a non-empty name of at most 200 characters without ':', NUL or control characters."


class GroupNotOpenError(GroupError):
    """The group is not open on this member's data plane."""

    hint = "Call open_group(group, ...) first, or check the group's name."


class GroupAlreadyOpenError(GroupError):
    """open_group() was called for a group that is already open."""

    hint = "A group is opened once per data plane; close_group() it first to change its mode."


class NotAMemberError(GroupError):
    """The DID named is not a member of the group on this data plane."""

    hint = "Add it with add_member(group, member) first, or check the DID against members(group)."


class ReadOnlyMemberError(GroupError):
    """A read-only member tried to publish data."""

    hint = ("Switch this member to read_write before publishing (switch_role(group, \"read_write\"), or "
            "`zerocomm group role GROUP read_write`); read-only members only receive.")


class BackpressureError(GroupError, TimeoutError):
    """Publishing waited for slow members until its deadline; nothing was sent or dropped."""

    hint = ("Members are not keeping up: retry later, give a longer timeout, or raise the window (window, "
            "window_bytes); stats()['lag'] and the named members show who is behind")


class MessagesDroppedError(GroupError):
    """Messages of a publish were dropped by retention before some member acked them: it never got them."""

    hint = ("The named members were inactive, or stalled (alive but no ack progress for ack_stall_s), while more "
            "than retention_max messages (or retention_max_bytes bytes) were published; publish those messages "
            "again (the same message ids: members that have them drop the copies) or raise retention_max and "
            "retention_max_bytes")


class DeliveryDeferredError(GroupError):
    """Delivered messages were not taken (a listener raised, or the group's join is not complete yet).

    The data plane does not acknowledge them: the publisher re-sends them and they are offered
    again, only to the listeners that did not take them.
    """

    hint = "A listener that keeps raising holds up that publisher's messages at this member: fix it or remove it"

    def __init__(self, message: str, *, hint: str | None = None, taken: int = 0, raised: int = 0) -> None:
        super().__init__(message, hint=hint)
        self.taken = taken  # the batch's first ``taken`` messages were taken by every listener: ack them
        self.raised = raised  # listener calls that raised (0: deferred for another reason, a join in progress)


class DataPlaneClosedError(GroupError):
    """The data plane was used after close() (or before start())."""

    hint = "Create and start() a new DataPlane; a closed one cannot restart."


class MalformedDataMessageError(ProtocolError):
    """A group data message (batch, ack, hello, resend) is not valid; it was dropped."""

    hint = "The sender runs an incompatible zerocomm-spark version or the message was forged; nothing was delivered."


# --- groups: membership -------------------------------------------------------------------------


class GroupExistsError(GroupError):
    """This member already has a group of that name (names are unique per member)."""

    hint = ("Pick another name, or leave the group first (leave(group), or `zerocomm group leave GROUP`); groups() "
            "(`zerocomm group list`) lists the names in use.")


class GroupNotFoundError(GroupError):
    """This member is not in a group of that name."""

    hint = ("Create it, or join it through a member (join(group, via=connection), or `zerocomm group join GROUP "
            "--via PEER`); groups() (`zerocomm group list`) lists yours.")


class JoinRefusedError(GroupError):
    """A member (the acceptor or another) refused the join or subscribe by its admission policy."""

    hint = ("Ask a member to add your DID (agent.groups.did) to its allow-list, or for an invitation issued "
            "for the group (agent.groups.invite(group)), then join again")


class InconsistentViewError(JoinRefusedError):
    """The members disagree on who is in the group, and the group refuses inconsistent joins."""

    hint = ("A member may hold a forged view (an intruder) or the group was changing; nothing was joined. "
            "Join through another member, or retry once the group is quiet")


class MalformedGroupMessageError(ProtocolError):
    """A group membership message (join, subscribe, status, digest, view) is not valid; it was dropped."""

    hint = "The sender runs an incompatible zerocomm-spark version, or the message was forged or altered."


# --- journal (zerocomm_spark.journal) ----------------------------------------------------------


class JournalError(ZeroCommError):
    """The member's message journal cannot be opened, written or read."""

    hint = "Check the journal directory's permissions and free space; reopen the journal to recover."


class JournalKeyError(JournalError):
    """The key given does not open this journal (or is not a 32-byte key)."""

    hint = "Pass the 32-byte key the journal was created with; the member keeps it sealed in its keystore."


class JournalLockedError(JournalError):
    """Another Journal (in this or another process) already holds the directory."""

    hint = "Close the other Journal or stop the process holding it; one writer per journal directory."


class JournalClosedError(JournalError):
    """The journal was used after close(), or stopped after a write failure."""

    hint = "Open it again with Journal.open(directory, key=...); reopening recovers from the files on disk."


class JournalCorruptError(JournalError):
    """A record on disk fails its length, checksum or authentication check."""

    hint = ("Other offset ranges remain readable; copy the named file aside for inspection and restore it "
            "from a replica or backup. The message names no payload or key.")


class JournalTimeoutError(JournalError, TimeoutError):
    """A journal operation did not complete within its deadline."""

    hint = ("The outcome is unknown: append the same rows again (duplicates are skipped), or check the disk "
            "if this repeats.")


class InvalidJournalRowError(JournalError, ValueError):
    """A row (or column) given to append() does not fit the journal schema."""

    hint = "See zerocomm_spark.journal.JOURNAL_SCHEMA: times are int microseconds since the epoch (UTC) or aware datetimes."


class OffsetOutOfRangeError(JournalError, IndexError):
    """The offset asked for is not in the journal (beyond its end, negative, or no longer retained)."""

    hint = "Ask Journal.earliest_offset() and Journal.latest().next_offset for the readable range."


class DataLossError(OffsetOutOfRangeError):
    """The offsets asked for were deleted by retention (or lost), so they can never be read."""

    hint = ("Restart reading from Journal.earliest_offset(), or fail the query (Spark: failOnDataLoss); "
            "commit() sooner or raise retention to keep more.")


# --- the agent process and its local API (zerocomm_spark.agent, zerocomm_spark.client) ---------


class AgentNotRunningError(ZeroCommError):
    """No agent answers on the local API socket (or TCP endpoint) that was named."""

    hint = ("Start one with `zerocomm agent start --detach` (or Client.connect(..., spawn=True)), "
            "or point the client at the right socket directory / --config")


class AgentStartError(ZeroCommError):
    """An agent process was started but did not come up (it exited or missed its deadline)."""

    hint = "See the agent's log file named in the message; `zerocomm agent start` in the foreground shows it live"


class ApiError(ZeroCommError):
    """A call on the agent's local API failed outside of what the call itself does."""

    hint = "Check the agent's log; `zerocomm agent status` shows whether it is healthy."


class ApiTimeoutError(ApiError, TimeoutError):
    """The agent did not answer a call within its deadline."""

    hint = ("The outcome is unknown: the agent may still complete the call. Retry with a longer timeout; "
            "publishing again with the same message ids delivers nothing twice")


class BadRequestError(ApiError, ValueError):
    """The agent refused a call it cannot parse: unknown call, missing or mistyped argument."""

    hint = "See `zerocomm --help` or the Client method's signature for the arguments each call takes."


class UnknownCallError(BadRequestError):
    """The call names nothing the agent serves."""

    hint = "Call one of the names the agent lists in the message (client and agent versions may differ)."


class BadRowError(BadRequestError):
    """The agent refuses a row of a publish call: its data, not the call (a null payload or header value,
    a message id too long or given twice, a header the group cannot carry). Row numbers count from 0
    within the call. A separate type so a caller (the Spark sink) can tell it from a call this agent
    cannot take at all (an unknown argument from a client of another version)."""

    hint = "Fix or leave out the row named (rows count from 0 within the publish call), then publish again"


class RequestTooLargeError(BadRequestError):
    """A request is bigger than the agent's api.max_request_bytes."""

    hint = "Split the batch into smaller ones, or raise api.max_request_bytes in the agent's configuration."


class ApiPermissionError(ApiError, PermissionError):
    """This user or key may not use the agent's API (socket directory not ours, CURVE key not allowed)."""

    hint = ("The local API serves only the user that runs the agent: run the client as that user, or list "
            "this client's CURVE public key in api.allowed_clients and use the TCP endpoint")


class AgentBusyError(ApiError):
    """The agent has too many calls in progress and refused this one."""

    hint = "Retry shortly, make fewer concurrent calls, or raise api.workers in the agent's configuration."


class ClientClosedError(ApiError):
    """The client was used after close()."""

    hint = "Connect again with Client.connect(...)."


# --- the Spark connector (zerocomm_spark.connector) --------------------------------------------


class ConnectorOptionError(ConfigurationError, ValueError):
    """An option given to format("zerocomm") is unknown, missing or malformed."""

    hint = "See the option table in connector/README.md; option names are case-insensitive."


class OffsetFormatError(ConnectorOptionError):
    """An offset (startingOffsets, endingOffsets, or a checkpointed offset) cannot be parsed."""

    hint = ('Offsets are JSON like {"group": {"publisher DID": seq}} (-2 earliest, -1 latest) or '
            '"earliest" / "latest"; a checkpoint written by a newer connector needs that version')


class SinkSchemaError(ConnectorOptionError):
    """The DataFrame written to format("zerocomm") does not have the columns the sink takes."""

    hint = ("Select a payload column (binary or string) and optionally message_id (string) and headers "
            "(map<string,string>), e.g. df.selectExpr(\"CAST(value AS STRING) AS payload\")")


#: What every SinkRowError's hint ends with: what the failed task had already published.
SINK_ROWS_BEFORE = ("the rows before it were published: a streaming query re-runs the batch under the same ids "
                    "(none is delivered twice), a df.write does so only with a message_id column")


class SinkRowError(ZeroCommError, ValueError):
    """A row written to format("zerocomm") cannot be a group message as it is: a data error, which fails
    the same way at every retry (unlike PublishNotAcknowledgedError, which a retry can get past).

    Not a ConnectorOptionError (a ConfigurationError): the options are fine, a row is not, so it must
    neither be caught as an option error nor map to the CLI's usage exit code."""

    hint = f"Fix or leave out the named row, then write again; {SINK_ROWS_BEFORE}"


class SinkPayloadTooLargeError(SinkRowError):
    """A row written to format("zerocomm") has a payload bigger than one group message carries."""

    hint = ("Split such payloads over several rows, or leave them out (df.where(octet_length(payload) <= LIMIT)); "
            + SINK_ROWS_BEFORE)


class SinkNullPayloadError(SinkRowError):
    """A row written to format("zerocomm") has a null payload; a group message always has one."""

    hint = ("Leave such rows out (df.where('payload IS NOT NULL')) or give them a value (coalesce(payload, '')); "
            + SINK_ROWS_BEFORE)


class SinkHeaderError(SinkRowError):
    """A row's headers cannot be a group message's: a null value, an empty key, too many or too long."""

    hint = ("Drop the entries with a null value (map_filter(headers, (k, v) -> v IS NOT NULL)) or fill them "
            "(transform_values(headers, (k, v) -> coalesce(v, ''))); " + SINK_ROWS_BEFORE)


class SinkOriginClaimError(SinkHeaderError):
    """With signOrigin, a row's headers already hold a zc-origin entry: the agent signs only its own claim."""

    hint = ("Drop the zc-origin entry from the headers column (map_filter(headers, (k, v) -> k != 'zc-origin')), "
            "or set signOrigin to false; " + SINK_ROWS_BEFORE)


class StreamContextError(ZeroCommError, RuntimeError):
    """A streaming write task came without the batch id Spark sets on it: the sink cannot derive message
    ids that differ between batches (equal rows of a later batch would be dropped as duplicates)."""

    hint = "Run the query on the Spark version this connector supports (pyspark 4.2); report it if you do"


class StreamDataLossError(DataLossError):
    """Messages a query should read next are gone from this member's journal (retention, or never received)."""

    hint = ("Restart the query from a new checkpoint, or set failOnDataLoss=false to skip what is gone with a "
            "warning; commit sooner (the query does after each batch) or raise journal retention")


class IncompleteReadError(ZeroCommError, TimeoutError):
    """The member on an executor's host did not have the messages a partition covers within readTimeoutMs."""

    hint = ("That host's member is behind or not in the group: check `zerocomm group list` and "
            "`zerocomm group members GROUP` there, or raise readTimeoutMs")


class PublishNotAcknowledgedError(GroupError):
    """A Spark write could not get every message acknowledged by the group; the batch was not committed."""

    hint = ("Nothing is lost and nothing will be delivered twice: rerun the query (or let Spark retry); it "
            "publishes the same message ids again. Check that the group's members are up, or raise publishTimeoutMs")


# --- history in Delta (zerocomm_spark.pipelines) -------------------------------------------------


class HistoryWriteConflictError(ZeroCommError):
    """Appending only the rows a history table lacks kept conflicting with other commits into the
    same partitions (an ingest, a restore, compact): nothing was written."""

    hint = "Run it again (only rows the table lacks are appended), or while no other job writes the same group's days"
