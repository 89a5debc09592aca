"""Aries RFC 0019 (DIDComm v1) encryption envelopes.

One content encryption key (CEK) encrypts the message once; the CEK is then wrapped for each
recipient's X25519 key (converted from its Ed25519 verkey). Authcrypt wraps it with ``crypto_box``
from the sender's key and hides the sender's verkey in a sealed box; anoncrypt wraps it in a sealed
box and names no sender.

Wire compatibility notes, taken from what interoperating agents actually emit:

* The protected header says ``"enc": "xchacha20poly1305_ietf"``, but RFC 0019's own pack algorithm
  (and the 12-byte ivs of its examples), ACA-Py and aries-staticagent all encrypt the body with
  ChaCha20-Poly1305 *IETF* and a 12-byte ``iv``. We emit exactly that, so Aries agents can read us
  (real XChaCha20 would not open in them); on unpack a 24-byte ``iv`` selects XChaCha20-Poly1305,
  so envelopes from an implementation that took the label literally open too.
* base64url is emitted padded, as the RFC examples and aries-staticagent do; unpadded input
  (which some agents send) is accepted.
* The AAD is the ``protected`` string exactly as transmitted, so re-encoding it is never needed.
"""

from __future__ import annotations

import binascii
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from typing import Any

import nacl.bindings as _nacl
import nacl.exceptions

try:  # SIMD base64 (several times faster on bodies of kilobytes); binascii when it is absent
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - pybase64 is a dependency
    _pybase64 = None

from zerocomm_spark.errors import (
    DIDError,
    EnvelopeError,
    MalformedEnvelopeError,
    NoRecipientKeyError,
    ProtocolError,
    TamperedEnvelopeError,
)
from zerocomm_spark.keys.keypair import KeyPair, verkey_bytes

__all__ = ["AUTHCRYPT", "ANONCRYPT", "Unpacked", "pack", "unpack"]

AUTHCRYPT = "Authcrypt"
ANONCRYPT = "Anoncrypt"
ENC = "xchacha20poly1305_ietf"
TYP = "JWM/1.0"

_CEK_BYTES = 32
_IV_BYTES = _nacl.crypto_aead_chacha20poly1305_ietf_NPUBBYTES  # 12: what Aries agents send
_XIV_BYTES = _nacl.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES  # 24: accepted on unpack
_TAG_BYTES = _nacl.crypto_aead_chacha20poly1305_ietf_ABYTES
_BOX_NONCE_BYTES = _nacl.crypto_box_NONCEBYTES
_WRAPPED_CEK_AUTH = _CEK_BYTES + _nacl.crypto_box_ZEROBYTES - _nacl.crypto_box_BOXZEROBYTES  # + MAC
_WRAPPED_CEK_ANON = _CEK_BYTES + _nacl.crypto_box_SEALBYTES

_aead_encrypt = _nacl.crypto_aead_chacha20poly1305_ietf_encrypt
_aead_decrypt = _nacl.crypto_aead_chacha20poly1305_ietf_decrypt
_xaead_decrypt = _nacl.crypto_aead_xchacha20poly1305_ietf_decrypt
_box = _nacl.crypto_box
_box_open = _nacl.crypto_box_open
_seal = _nacl.crypto_box_seal
_seal_open = _nacl.crypto_box_seal_open

# Standard <-> url-safe alphabets. '+' and '/' in the input map to an invalid byte so strict
# decoding rejects them: the url-safe form is the only spelling we take.
_TO_STD = bytes.maketrans(b"-_+/", b"+/!!")
_TO_URL = bytes.maketrans(b"+/", b"-_")
_PAD = (b"", b"===", b"==", b"=")

_CRYPTO_FAILURES = (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, nacl.exceptions.TypeError)


# --- encodings ---------------------------------------------------------------------------------


if _pybase64 is not None:
    _pb_decode = _pybase64.b64decode
    _pb_encode = _pybase64.b64encode

    def _decode_url(data: bytes) -> bytes:
        """Strict decode of padded base64url (length a multiple of 4); binascii.Error if invalid.

        pybase64 given the url-safe altchars still takes '+' and '/', so they are refused first
        (memchr); otherwise it is exactly as strict as binascii's strict mode on such input.
        """
        if b"+" in data or b"/" in data:
            raise binascii.Error("'+' and '/' are not base64url")
        return _pb_decode(data, b"-_", True)

    def _encode_url(data: bytes | memoryview) -> bytes:
        """Padded base64url."""
        return _pb_encode(data, b"-_")

else:  # pragma: no cover - pybase64 is a dependency

    def _decode_url(data: bytes) -> bytes:
        """Strict decode of padded base64url (length a multiple of 4); binascii.Error if invalid."""
        return binascii.a2b_base64(data.translate(_TO_STD), strict_mode=True)

    def _encode_url(data: bytes | memoryview) -> bytes:
        """Padded base64url."""
        return binascii.b2a_base64(data, newline=False).translate(_TO_URL)


def _b64url(data: bytes | memoryview) -> str:
    """Padded base64url, as in RFC 0019's examples."""
    return _encode_url(data).decode("ascii")


def _unb64url(text: Any, what: str) -> bytes:
    """Strict base64url decode, padded or not; ``what`` names the field in errors, never its value."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    if not isinstance(raw, bytes):
        raise MalformedEnvelopeError(f"the envelope field {what!r} must be a base64url string")
    try:
        if not len(raw) & 3 and not raw.endswith(b"==="):
            # Padded (what pack and most agents send): strict decoding checks the padding itself.
            return _decode_url(raw)
        data = raw.rstrip(b"=")
        padding = len(raw) - len(data)
        if padding and (padding > 2 or len(raw) & 3):
            raise ValueError("bad padding")
        return _decode_url(data + _PAD[len(data) & 3])
    except (binascii.Error, ValueError):
        raise MalformedEnvelopeError(f"the envelope field {what!r} is not valid base64url") from None


@lru_cache(maxsize=8192)
def _x25519(verkey: str) -> bytes:
    """X25519 public key of a verkey; cached because the same peers recur on every message."""
    # base58 text only: no whitespace the decoder would forgive, nothing JSON would have to escape
    if not (isinstance(verkey, str) and verkey.isascii() and verkey.isalnum()):
        raise DIDError("a verkey must be a base58 string")
    try:
        return _nacl.crypto_sign_ed25519_pk_to_curve25519(verkey_bytes(verkey))
    except _CRYPTO_FAILURES as exc:
        raise DIDError("the verkey is not a valid Ed25519 point") from exc


def _message_bytes(message: bytes | bytearray | memoryview | str | dict[str, Any]) -> bytes:
    if isinstance(message, bytes):
        return message
    if isinstance(message, str):
        return message.encode("utf-8")
    if isinstance(message, dict):
        # ASCII JSON (non-ASCII as \u escapes): agents that decode the body as ASCII still read it.
        return json.dumps(message, separators=(",", ":")).encode("ascii")
    if isinstance(message, (bytearray, memoryview)):
        return bytes(message)
    raise TypeError(f"pack() takes bytes, str or dict, not {type(message).__name__}")


# --- pack --------------------------------------------------------------------------------------

_HEADER = '{"enc":"%s","typ":"%s","alg":"%%s","recipients":[%%s]}' % (ENC, TYP)
_AUTH_ENTRY = '{"encrypted_key":"%s","header":{"kid":"%s","sender":"%s","iv":"%s"}}'
_ANON_ENTRY = '{"encrypted_key":"%s","header":{"kid":"%s"}}'


def pack(
    message: bytes | str | dict[str, Any],
    recipient_verkeys: Sequence[str],
    sender: KeyPair | None = None,
) -> bytes:
    """Encrypt ``message`` once for all ``recipient_verkeys``: authcrypt from ``sender``, else anoncrypt.

    Returns the JSON envelope as bytes, ready for the wire. A recipient listed twice is wrapped for once.
    """
    if isinstance(recipient_verkeys, str):
        raise TypeError("recipient_verkeys is a sequence of verkeys, not one verkey string")
    verkeys = list(dict.fromkeys(recipient_verkeys))
    if not verkeys:
        raise EnvelopeError("an envelope needs at least one recipient verkey", hint="Pass the recipients' verkeys.")
    body = _message_bytes(message)
    cek = os.urandom(_CEK_BYTES)

    # The header is formatted, not json.dumps'd: every value is a checked base58 verkey, base64url
    # or a constant, none of which JSON ever escapes, and json.dumps costs ~5 us per recipient.
    if sender is not None:
        sender_vk = sender.verkey.encode("ascii")
        sender_sk = bytes(sender.x25519_private())
        entries = []
        for vk in verkeys:
            target = _x25519(vk)
            nonce = os.urandom(_BOX_NONCE_BYTES)
            entries.append(
                _AUTH_ENTRY
                % (_b64url(_box(cek, nonce, target, sender_sk)), vk, _b64url(_seal(sender_vk, target)), _b64url(nonce))
            )
        alg = AUTHCRYPT
    else:
        entries = [_ANON_ENTRY % (_b64url(_seal(cek, _x25519(vk))), vk) for vk in verkeys]
        alg = ANONCRYPT
    header = (_HEADER % (alg, ",".join(entries))).encode("ascii")
    protected = _encode_url(header)
    iv = os.urandom(_IV_BYTES)
    sealed = memoryview(_aead_encrypt(body, protected, iv, cek))
    # Every value is base64url (no JSON escaping possible), so the envelope is joined directly.
    return b"".join(
        (
            b'{"protected":"',
            protected,
            b'","iv":"',
            _b64url(iv).encode("ascii"),
            b'","ciphertext":"',
            _encode_url(sealed[:-_TAG_BYTES]),
            b'","tag":"',
            _encode_url(sealed[-_TAG_BYTES:]),
            b'"}',
        )
    )


# --- unpack ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A decrypted, authenticated message and who it was between.

    ``sender_verkey`` is None for anoncrypt. The plaintext is kept out of the repr.
    """

    message: bytes = field(repr=False)
    recipient_verkey: str
    sender_verkey: str | None

    def json(self) -> dict[str, Any]:
        """The message as a DIDComm JSON object."""
        try:
            value = json.loads(self.message)
        except (ValueError, RecursionError):
            raise ProtocolError("the decrypted message is not JSON") from None
        if not isinstance(value, dict):
            raise ProtocolError("the decrypted message is not a JSON object")
        return value


def _load_json(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        raise MalformedEnvelopeError(f"the {what} is not valid JSON (truncated or not an RFC 0019 envelope)") from None
    if not isinstance(value, dict):
        raise MalformedEnvelopeError(f"the {what} is not a JSON object")
    return value


_Fields = tuple[bytes, bytes, bytes, bytes]  # protected, iv, ciphertext, tag: still base64url


def _split_compact(envelope: bytes) -> _Fields | None:
    """Fast path for the compact layout ``pack`` (and most agents) emit; None means "parse as JSON".

    Spares a full JSON scan of the (large) ciphertext. Envelopes with escapes fall back, and every
    value cut here is strictly base64url-decoded later, so what this accepts reads exactly as
    json.loads would read it. (find() is memchr; bytes.split on one byte would walk byte by byte.)
    """
    if not envelope.startswith(b'{"protected":"') or b"\\" in envelope:
        return None
    find = envelope.find
    end_protected = find(b'"', 14)
    if not envelope.startswith(b'","iv":"', end_protected):
        return None
    end_iv = find(b'"', end_protected + 8)
    if not envelope.startswith(b'","ciphertext":"', end_iv):
        return None
    end_ciphertext = find(b'"', end_iv + 16)
    if not envelope.startswith(b'","tag":"', end_ciphertext):
        return None
    end_tag = find(b'"', end_ciphertext + 9)
    if end_tag != len(envelope) - 2 or envelope[-1:] != b"}":
        return None
    return (
        envelope[14:end_protected],
        envelope[end_protected + 8 : end_iv],
        envelope[end_iv + 16 : end_ciphertext],
        envelope[end_ciphertext + 9 : end_tag],
    )


def _split_json(envelope: bytes) -> _Fields:
    outer = _load_json(envelope, "envelope")
    values = []
    for name in ("protected", "iv", "ciphertext", "tag"):
        value = outer.get(name)
        if not isinstance(value, str):
            raise MalformedEnvelopeError(f"the envelope has no {name!r} field")
        try:
            values.append(value.encode("ascii"))
        except UnicodeEncodeError:
            raise MalformedEnvelopeError(f"the envelope field {name!r} is not valid base64url") from None
    return values[0], values[1], values[2], values[3]


def _tampered(what: str) -> TamperedEnvelopeError:
    return TamperedEnvelopeError(f"{what} failed to authenticate")


def unpack(envelope: bytes | str, lookup: Callable[[str], KeyPair | None]) -> Unpacked:
    """Decrypt an RFC 0019 envelope with the first recipient key ``lookup`` returns.

    ``lookup(kid)`` gets each recipient verkey in order and returns our KeyPair for it, or None.
    Nothing is returned unless the CEK unwrap and the body's AEAD tag both verify.

    Envelopes in the compact layout ``pack`` emits take a fast path that decodes only the parts of
    the protected header it needs (see :func:`_unpack_compact`); everything else, and every envelope
    the fast path cannot open, goes through the reference path, which parses the whole envelope as
    JSON and so decides every error.
    """
    if isinstance(envelope, str):
        envelope = envelope.encode("utf-8", "replace")  # a lone surrogate becomes '?': malformed, not a crash
    elif isinstance(envelope, (bytearray, memoryview)):
        envelope = bytes(envelope)
    elif not isinstance(envelope, bytes):
        raise TypeError(f"unpack() takes bytes or str, not {type(envelope).__name__}")
    fields = _split_compact(envelope)
    if fields is not None:
        try:
            result = _unpack_compact(fields, lookup)
        except _FAST_PATH_MISSES:
            result = None
        if result is not None:
            return result
    else:
        fields = _split_json(envelope)
    return _unpack_reference(fields, lookup)


# --- unpack: the fast path ----------------------------------------------------------------------
#
# pack writes the protected header as one fixed template (see _HEADER, _AUTH_ENTRY, _ANON_ENTRY):
#
#   {"enc":"xchacha20poly1305_ietf","typ":"JWM/1.0","alg":"<alg>","recipients":[<entry>,<entry>...]}
#   <entry> = {"encrypted_key":"<ek>","header":{"kid":"<kid>","sender":"<s>","iv":"<iv>"}}  (Authcrypt)
#           | {"encrypted_key":"<ek>","header":{"kid":"<kid>"}}                            (Anoncrypt)
#
# Base64 decodes group by group (4 characters -> 3 bytes), so any byte range of the header can be
# decoded on its own. The fast path checks the header's fixed start (enc, typ, alg) and end on the
# encoded text, decodes and strictly parses the first entry, which gives the lengths every entry of
# this envelope shares (ek and iv have fixed sizes, s depends only on the sender), then steps from
# kid to kid, reading each from a small window (`:"<kid>","sen` or `:"<kid>"}}`), and looks the
# kids up in order, stopping at the first key we hold. Our own entry is then decoded whole and
# parsed strictly. Nothing is JSON-parsed, and with many recipients most of the header is never
# decoded: it is only authenticated, as the AEAD's associated data.
#
# A kid window holds only template bytes and the kid, so the same recipient at the same position
# yields the same window text in every envelope. Windows already read are kept (bounded, like the
# X25519 conversions; kids are public), and so is each recipient list walked before: an envelope
# for the same recipients, as a group's traffic is, is checked against it with one comparison of
# all its kid windows, then only the look-ups remain.
#
# What the fast path does not check is the bytes of *other* recipients' ek, sender and iv values,
# which it steps over. Changing them, or anything else in the header, breaks the AEAD tag for
# anyone who does not hold the CEK, and nothing is returned. The fast path only ever returns a
# success: anything unexpected (another layout, spacing, escapes, a kid that is not alphanumeric, a
# failed unwrap or tag) makes it give up, and the reference path decides the outcome from the full
# JSON, so every error keeps its type and message.

_FAST_PATH_MISSES = (EnvelopeError, binascii.Error, ValueError, IndexError, *_CRYPTO_FAILURES)

_B64V = rb"[A-Za-z0-9_=-]*"
_KID = rb"[A-Za-z0-9]+"  # verkeys are base58; other kids take the reference path
_AUTH_ENTRY_RE = re.compile(
    rb'\{"encrypted_key":"(' + _B64V + rb')","header":\{"kid":"(' + _KID + rb')","sender":"('
    + _B64V + rb')","iv":"(' + _B64V + rb')"\}\}'
)
_ANON_ENTRY_RE = re.compile(rb'\{"encrypted_key":"(' + _B64V + rb')","header":\{"kid":"(' + _KID + rb')"\}\}')
_KID_OFFSET = len(b'{"encrypted_key":"') + len(b'","header":{"kid":"')  # + len(ek): where an entry's kid starts
_KID_SPAN = 54  # a kid window ends before byte kid+54: past the longest kid (44), still inside what follows it
_AFTER_KID = {AUTHCRYPT: b'","sen', ANONCRYPT: b'"}}'}
_KID_CACHE_MAX = 4096
# Kid windows already read, per alg. A window's decoded start (':"', '":"' or 'd":"') fixes where its
# kid is, so the text alone is the key.
_kid_windows: dict[str, dict[bytes, str]] = {AUTHCRYPT: {}, ANONCRYPT: {}}
# A kid window's length in characters, by the position of its ':"' mod 3.
_KID_WINDOW_CHARS = tuple(4 * ((r + _KID_SPAN + 2) // 3) for r in range(3))
# Recipient lists already walked (see _walk_kids), bounded.
_RECIPIENT_LISTS_MAX = 256
# key -> (getter of its kid windows, their texts as the getter returns them, marks, kids, texts)
_recipient_lists: dict[tuple[str, int, int, int, str], tuple[Callable[[bytes], Any], Any, list[int], list[str], list[bytes]]] = {}


def _template_start(alg: str) -> tuple[bytes, int]:
    """The base64url text every compact header of ``alg`` starts with, and where its first entry begins."""
    prefix = (_HEADER % (alg, "")).encode("ascii")[:-2]  # up to and with the recipients' '['
    assert prefix.endswith(b'"recipients":[')
    head = prefix + b'{"encrypted_key":"'
    return _b64url(head[: len(head) // 3 * 3]).encode("ascii"), len(prefix)


def _template_ends() -> tuple[bytes, bytes, bytes]:
    """By header length mod 3: the base64url text every compact header ends with (`"}}]}`)."""
    tail = b'"}}]}'
    ends = []
    for rest in range(3):  # header length mod 3: bytes in the last, partial group
        whole = (len(tail) - rest) // 3 * 3
        ends.append(_b64url(tail[len(tail) - rest - whole :]).encode("ascii"))
    return ends[0], ends[1], ends[2]


_STARTS = {AUTHCRYPT: _template_start(AUTHCRYPT), ANONCRYPT: _template_start(ANONCRYPT)}
_AUTH_START, _FIRST_ENTRY = _STARTS[AUTHCRYPT]
_ANON_START = _STARTS[ANONCRYPT][0]
assert _STARTS[ANONCRYPT][1] == _FIRST_ENTRY
_ENDS = _template_ends()


def _decode_range(protected: bytes, start: int, stop: int) -> tuple[bytes, int]:
    """Header bytes [start, stop) (or fewer at the end) as (decoded groups, index of ``start`` in them)."""
    group = start // 3
    return (
        _decode_url(protected[4 * group : -(-stop // 3) * 4]),
        start - 3 * group,
    )


def _walk_kids(
    protected: bytes, alg: str, header_len: int, mark: int, stride: int, kid: str, lookup: Callable[[str], KeyPair | None]
) -> tuple[int, str, KeyPair] | None:
    """Step from kid to kid after the first entry (whose ':"' is at ``mark``): the first held one.

    Returns where that kid's ':"' is, the kid and its key pair; None if no later kid is held or
    the windows are not where the first entry's lengths put them. A kid window starts at the group
    holding the ':"' before the kid and ends before byte kid + _KID_SPAN, so it holds template
    bytes and the kid only: all ASCII, whose base64 never uses '-' or '_', so it decodes without
    translating (a '-' or '_' fails strictly, which is right). The windows a walk went through are
    remembered under the envelope's shape (alg, header length, first entry's geometry and kid): an
    envelope for the same recipients is checked against them in one comparison, not walked again.
    """
    key = (alg, header_len, mark, stride, kid)
    known = _recipient_lists.get(key)
    if known is not None and known[0](protected) == known[1]:
        for mark, kid in zip(known[2], known[3]):
            keypair = lookup(kid)
            if keypair is not None and keypair.verkey == kid:
                return mark, kid, keypair
        marks, texts, kids = list(known[2]), list(known[4]), list(known[3])  # none is ours: walk on
    else:
        marks, texts, kids = [], [], []
    last_mark = header_len - stride - 2 + (mark - _FIRST_ENTRY)  # the last entry is followed by ']}'
    windows = _kid_windows[alg]
    after = _AFTER_KID[alg]
    chars = _KID_WINDOW_CHARS
    decode = binascii.a2b_base64
    while True:
        mark += stride + len(kid)
        if mark > last_mark:
            return None
        group = mark // 3
        r = mark - 3 * group  # the window's ':"' is at r, its kid at r + 2
        group *= 4
        text = protected[group : group + chars[r]]
        kid = windows.get(text)
        if kid is None:
            window = decode(text, strict_mode=True)
            end = window.find(b'"', r + 2)
            raw = window[r + 2 : end]
            if not (end > r + 2 and window.startswith(b':"', r) and window.startswith(after, end) and raw.isalnum()):
                return None
            if len(windows) >= _KID_CACHE_MAX:
                windows.clear()
            kid = windows[text] = raw.decode("ascii")
        marks.append(mark)
        texts.append(text)
        kids.append(kid)
        keypair = lookup(kid)
        if keypair is not None and keypair.verkey == kid:
            break
    windows_of = itemgetter(*[slice(4 * (m // 3), 4 * (m // 3) + chars[m % 3]) for m in marks])
    if len(_recipient_lists) >= _RECIPIENT_LISTS_MAX:
        _recipient_lists.clear()
    _recipient_lists[key] = (windows_of, tuple(texts) if len(texts) > 1 else texts[0], marks, kids, texts)
    return mark, kid, keypair


def _unpack_compact(fields: _Fields, lookup: Callable[[str], KeyPair | None]) -> Unpacked | None:
    """The fast path for pack's own layout; None (or an exception) means "use the reference path"."""
    protected, iv_text, ciphertext_text, tag_text = fields
    if protected.startswith(_AUTH_START):
        alg, entry_re, first_span = AUTHCRYPT, _AUTH_ENTRY_RE, 330
    elif protected.startswith(_ANON_START):
        alg, entry_re, first_span = ANONCRYPT, _ANON_ENTRY_RE, 200
    else:
        return None
    size = len(protected)
    if size & 3:
        return None  # pack pads; unpadded headers take the reference path
    header_len = size // 4 * 3 - (protected[-1] == 61) - (protected[-2] == 61)  # 61: '='
    if not protected.endswith(_ENDS[header_len % 3]):
        return None

    # The first entry, parsed strictly, gives the lengths all entries of this envelope share.
    start = _FIRST_ENTRY
    window, at = _decode_range(protected, start, start + first_span)
    match = entry_re.match(window, at)
    if match is None:
        return None
    kid = match[2].decode("ascii")
    keypair = lookup(kid)
    if keypair is None or keypair.verkey != kid:
        colon = _KID_OFFSET - 2 + len(match[1])  # where the ':"' before an entry's kid is, in the entry
        stride = match.end() - at - len(match[2]) + 1  # an entry without its kid, plus the ',' after it
        found = _walk_kids(protected, alg, header_len, start + colon, stride, kid, lookup)
        if found is None:
            return None  # no entry of ours, or not the layout we think: the reference path decides
        mark, kid, keypair = found
        start = mark - colon
        entry_len = stride - 1 + len(kid)
        window, at = _decode_range(protected, start, start + entry_len)
        match = entry_re.match(window, at)
        if match is None or match.end() - at != entry_len or match[2] != kid.encode("ascii"):
            return None

    # Our entry, decoded whole and matched strictly: unwrap the CEK, then open the body. The
    # base64 fields are decoded together where they are whole groups (only the last padded).
    if alg == AUTHCRYPT:
        ek_text, nonce_text, sender_text = match[1], match[4], match[3]
        if (len(ek_text) | len(nonce_text) | len(sender_text)) & 3 or sender_text.endswith(b"==="):
            return None
        data = _decode_url(ek_text + nonce_text + sender_text)
        ek_end = len(ek_text) // 4 * 3
        nonce_end = ek_end + len(nonce_text) // 4 * 3
        sender_verkey, cek = _unwrap_authcrypt(data[:ek_end], data[nonce_end:], data[ek_end:nonce_end], keypair)
    else:
        sender_verkey, cek = None, _unwrap_anoncrypt(_unb64url(match[1], "encrypted_key"), keypair)
    if (len(iv_text) | len(tag_text)) & 3 or tag_text.endswith(b"==="):
        return None
    data = _decode_url(iv_text + tag_text)
    iv_end = len(iv_text) // 4 * 3
    return _open_body(
        protected, data[:iv_end], _unb64url(ciphertext_text, "ciphertext"), data[iv_end:], cek, keypair, sender_verkey
    )


# --- unpack: the reference path -----------------------------------------------------------------


def _unpack_reference(fields: _Fields, lookup: Callable[[str], KeyPair | None]) -> Unpacked:
    """Parse the whole protected header as JSON, then unwrap and open: decides every error."""
    protected, iv_text, ciphertext_text, tag_text = fields
    if not protected:
        raise MalformedEnvelopeError("the envelope's 'protected' header is empty")
    header = _load_json(_unb64url(protected, "protected"), "protected header")
    if header.get("enc") != ENC:
        raise MalformedEnvelopeError(f"unsupported content encryption (enc must be {ENC!r})")
    alg = header.get("alg")
    if alg != AUTHCRYPT and alg != ANONCRYPT:
        raise MalformedEnvelopeError(f"unsupported alg (must be {AUTHCRYPT!r} or {ANONCRYPT!r})")
    recipients = header.get("recipients")
    if not isinstance(recipients, list) or not recipients:
        raise MalformedEnvelopeError("the protected header lists no recipients")

    entry, entry_header, keypair = _find_recipient(recipients, lookup)
    sender_verkey, cek = _unwrap_cek(alg, entry, entry_header, keypair)
    iv = _unb64url(iv_text, "iv")
    tag = _unb64url(tag_text, "tag")
    if len(tag) != _TAG_BYTES:
        raise _tampered("the message tag")
    if len(iv) != _IV_BYTES and len(iv) != _XIV_BYTES:
        raise _tampered("the message iv")
    return _open_body(protected, iv, _unb64url(ciphertext_text, "ciphertext"), tag, cek, keypair, sender_verkey)


def _open_body(
    protected: bytes, iv: bytes, ciphertext: bytes, tag: bytes, cek: bytes, keypair: KeyPair, sender_verkey: str | None
) -> Unpacked:
    if len(tag) != _TAG_BYTES:
        raise _tampered("the message tag")
    if len(iv) == _IV_BYTES:
        decrypt = _aead_decrypt
    elif len(iv) == _XIV_BYTES:
        decrypt = _xaead_decrypt
    else:
        raise _tampered("the message iv")
    try:
        message = decrypt(ciphertext + tag, protected, iv, cek)
    except _CRYPTO_FAILURES:
        raise _tampered("the message body or protected header") from None
    return Unpacked(message, keypair.verkey, sender_verkey)


def _find_recipient(
    recipients: list[Any], lookup: Callable[[str], KeyPair | None]
) -> tuple[dict[str, Any], dict[str, Any], KeyPair]:
    """Our entry: the first whose kid ``lookup`` resolves to a key pair with that very verkey."""
    for entry in recipients:
        entry_header = entry.get("header") if isinstance(entry, dict) else None
        kid = entry_header.get("kid") if isinstance(entry_header, dict) else None
        if not isinstance(kid, str):
            raise MalformedEnvelopeError("a recipient entry has no header.kid")
        keypair = lookup(kid)
        if keypair is not None and keypair.verkey == kid:
            return entry, entry_header, keypair
    raise NoRecipientKeyError(f"none of the envelope's {len(recipients)} recipient key(s) is held here")


def _unwrap_cek(
    alg: str, entry: dict[str, Any], entry_header: dict[str, Any], keypair: KeyPair
) -> tuple[str | None, bytes]:
    """Recover the CEK (and, for authcrypt, the sender verkey) from our recipient entry."""
    encrypted_key = _unb64url(entry.get("encrypted_key"), "encrypted_key")
    enc_sender = entry_header.get("sender")
    nonce_text = entry_header.get("iv")
    if alg == ANONCRYPT:
        if enc_sender is not None or nonce_text is not None:
            raise MalformedEnvelopeError("an Anoncrypt recipient entry carries sender fields")
        return None, _unwrap_anoncrypt(encrypted_key, keypair)
    if enc_sender is None or nonce_text is None:
        raise MalformedEnvelopeError("an Authcrypt recipient entry lacks header.sender or header.iv")
    sealed_sender = _unb64url(enc_sender, "sender")
    nonce = _unb64url(nonce_text, "header.iv")
    return _unwrap_authcrypt(encrypted_key, sealed_sender, nonce, keypair)


def _unwrap_anoncrypt(encrypted_key: bytes, keypair: KeyPair) -> bytes:
    if len(encrypted_key) != _WRAPPED_CEK_ANON:
        raise _tampered("the recipient's encrypted_key")
    my_pk, my_sk = keypair.x25519_raw()
    try:
        return _seal_open(encrypted_key, my_pk, my_sk)
    except _CRYPTO_FAILURES:
        raise _tampered("the recipient's encrypted_key") from None


def _unwrap_authcrypt(encrypted_key: bytes, sealed_sender: bytes, nonce: bytes, keypair: KeyPair) -> tuple[str, bytes]:
    my_pk, my_sk = keypair.x25519_raw()
    try:
        sender_verkey = _seal_open(sealed_sender, my_pk, my_sk).decode("ascii")
        sender_pk = _x25519(sender_verkey)
    except (*_CRYPTO_FAILURES, UnicodeDecodeError, DIDError):
        raise _tampered("the recipient's sender field") from None
    if len(nonce) != _BOX_NONCE_BYTES or len(encrypted_key) != _WRAPPED_CEK_AUTH:
        raise _tampered("the recipient's encrypted_key or iv")
    try:
        return sender_verkey, _box_open(encrypted_key, nonce, sender_pk, my_sk)
    except _CRYPTO_FAILURES:
        raise _tampered("the recipient's encrypted_key or iv") from None
