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


# --- configuration and usage -------------------------------------------------------------------


class ConfigurationError(ZeroCommError):
    """A setting, option or argument is missing or malformed."""

    hint = "Check the named setting against conf/zerocomm.toml and the README."


# --- keys and identities -----------------------------------------------------------------------


class KeystoreError(ZeroCommError):
    """The sealed keystore cannot be opened or written."""

    hint = "Check the identity directory's permissions and the passphrase."


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

    hint = "Send smaller messages or raise transport.max_frame_bytes on both members."


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

    hint = "Send smaller messages or raise transport.max_frame_bytes on both members."


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

    hint = "Accept an invitation from that peer first (agent.accept(url)) or check the peer's DID."


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


class ReceiveTimeoutError(ZeroCommError, TimeoutError):
    """No message arrived within the deadline given to receive()."""

    hint = "Nothing was lost; call receive() again or give a longer timeout."


class AgentClosedError(ZeroCommError):
    """The agent was used after close()."""

    hint = "Open the agent again with Agent.open(path)."


class AgentAlreadyRunningError(ZeroCommError):
    """Another agent already holds this identity directory."""

    hint = "Stop the other agent or use another identity directory."
