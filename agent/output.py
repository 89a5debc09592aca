"""How the zerocomm command talks to people and scripts: aligned tables, JSON, a progress line.

Why separate: every command prints either for a person (tables, short texts, a progress display on
stderr only when stderr is a terminal) or for a script (one JSON document, or JSON lines for a
stream), and the choice must be the same everywhere.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

__all__ = ["Progress", "emit_json", "printable", "render_table", "short_did", "format_time", "format_payload",
           "json_payload", "json_headers"]


# DEL and the C1 controls: json.dumps leaves them raw with ensure_ascii=False, and a terminal may act on
# them (U+009B is a CSI). In JSON output they can only be inside strings, where \u escapes mean the same.
# Lone surrogates (undecodable bytes from argv or the environment) too: raw, stdout writes them as
# bytes that are not UTF-8 and the whole line is no longer JSON a parser takes.
_RAW_CONTROLS = re.compile("[\x7f-\x9f\ud800-\udfff]")


def emit_json(value: Any, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    text = json.dumps(value, default=str, ensure_ascii=False)
    out.write(_RAW_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")
    out.flush()


def json_payload(payload: bytes | None) -> dict[str, str | None]:
    """A payload for JSON output, exactly: ``payload`` its UTF-8 text (control characters JSON-escaped;
    the hex marker of format_payload if it is not UTF-8), ``payload_base64`` its bytes, always."""
    if payload is None:
        return {"payload": None, "payload_base64": None}
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = format_payload(payload)
    return {"payload": text, "payload_base64": base64.b64encode(payload).decode("ascii")}


def json_headers(headers: Any) -> dict[str, str] | None:
    """A row's headers for JSON output: an object, as the column's type (map<string,string>) says, not
    the list of [key, value] pairs Arrow gives for a map (`jq '.headers["zc-origin"]'` works)."""
    if headers is None:
        return None
    return dict(headers.items() if isinstance(headers, Mapping) else headers)


def printable(text: str, keep: str = "") -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``), except those in ``keep``.

    Labels, basic messages and error texts come from peers: printed raw, their escape sequences
    would drive the reader's terminal (rewrite the screen, the window title, what was "received").
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def short_did(did: str | None, width: int = 24) -> str:
    """DIDs are ~200 characters; the head and tail are enough to tell members apart on screen."""
    if not did:
        return "-"
    if len(did) <= width:
        return did
    keep = (width - 3) // 2
    return f"{did[:keep + 3]}...{did[-keep:]}" if did.startswith("did:") else f"{did[:keep]}...{did[-keep:]}"


def format_time(value: Any) -> str:
    """Seconds or microseconds since the epoch, an ISO string or a datetime -> local ISO time, seconds precision."""
    if value is None or value == "":
        return "-"
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    elif isinstance(value, (int, float)):
        seconds = value / 1e6 if value > 1e11 else float(value)
        dt = datetime.fromtimestamp(seconds, tz=timezone.utc)
    else:
        try:
            dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            return str(value)
    return dt.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_payload(payload: bytes | None, width: int | None = None) -> str:
    """UTF-8 text as itself, its control characters escaped as Python writes them (``multi\\nline``:
    one line per row, and a terminal never receives an escape sequence); anything else as a marked
    hex prefix (raw bytes have no place on a terminal). In text that needed escapes a backslash is
    doubled too, so a newline and the two characters ``\\n`` do not look alike there."""
    if payload is None:
        return ""
    try:
        decoded = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = f"<{len(payload)} bytes: {payload[:16].hex()}{'...' if len(payload) > 16 else ''}>"
    else:
        cut = width is not None and len(decoded) > width
        # Only what can be shown is escaped (escaping never shortens): a 4 MB text costs no more than a line.
        text = _escaped(decoded[:width] if width is not None else decoded)
        if cut:
            text += "..."
    if width is not None and len(text) > width:
        text = text[: max(width - 3, 1)] + "..."
    return text


def _escaped(text: str) -> str:
    if all(c.isprintable() or c == "\t" for c in text):
        return text
    return "".join("\\\\" if c == "\\" else c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in text)


def render_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]],
                 empty: str = "(none)") -> str:
    """Rows as a left-aligned table with a header; ``columns`` are (key, title)."""
    data = [[("-" if row.get(key) is None else printable(str(row.get(key)))) for key, _ in columns] for row in rows]
    if not data:
        return empty
    titles = [title for _, title in columns]
    widths = [max(len(titles[i]), *(len(r[i]) for r in data)) for i in range(len(columns))]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in data]
    return "\n".join(lines)


def render_pairs(pairs: Iterable[tuple[str, Any]]) -> str:
    """Key-value lines, keys aligned: for single objects (status, info)."""
    items = [(printable(k), "-" if v is None else printable(str(v))) for k, v in pairs]
    if not items:
        return ""
    width = max(len(k) for k, _ in items)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in items)


class Progress:
    """A one-line progress display on stderr, only when it is a terminal (scripts see nothing).

    A spinner keeps moving while the agent works, and the latest report (phase, done/total) is
    shown beside it, so a long join visibly progresses.
    """

    _FRAMES = "|/-\\"

    def __init__(self, what: str, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.what = what
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._info: dict[str, Any] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._thread = threading.Thread(target=self._spin, name="zerocomm-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self.stream.write("\r\033[K")
            self.stream.flush()

    def update(self, info: Mapping[str, Any]) -> None:
        with self._lock:
            self._info = dict(info)

    def line(self, frame: int) -> str:
        with self._lock:
            info = dict(self._info)
        elapsed = time.monotonic() - self._started
        parts = [f"{self._FRAMES[frame % len(self._FRAMES)]} {self.what}"]
        phase = info.get("phase")
        if phase:
            parts.append(str(phase))
        done, total = info.get("done"), info.get("total")
        if isinstance(done, int) and isinstance(total, int) and total > 0:
            filled = int(20 * min(done, total) / total)
            parts.append(f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total}")
        parts.append(f"{elapsed:.1f}s")
        return "  ".join(parts)

    def _spin(self) -> None:
        frame = 0
        while not self._stop.wait(0.1):
            self.stream.write("\r\033[K" + self.line(frame))
            self.stream.flush()
            frame += 1
