"""How the dashboard treats what it did not write: text from users and scripts, and the browser's request.

Owns :func:`plain`, the one way a user-supplied string (run, script and file names, a script's own ``name``,
config values, tensor names, exception text, a check's problem text) reaches a Streamlit element that renders
Markdown: alerts, captions, widget labels and help, format_func labels, metric and expander labels, toasts,
progress text. Long or multi-line text that should keep its layout goes to ``st.code`` / ``st.text`` instead.
Also owns the reading of a number from the URL (:func:`url_count`), and the per-session Host check (:func:`host_allowed`): a DNS-rebinding page reaches the server under
its own name, so a session whose ``Host`` is not loopback or a configured name is given no data.
This module must not import the store, torch or anything that starts a process.
"""

from __future__ import annotations

import os
import re
import string
import unicodedata
from urllib.parse import urlsplit

#: Every ASCII punctuation character is escapable in CommonMark; Streamlit adds directives on top (``:red[…]``,
#: ``:material/x:``, emoji shortcodes, ``$…$`` maths), so all of them are escaped, not a chosen few.
_PUNCTUATION = re.compile("([" + re.escape(string.punctuation) + "])")

#: Hosts a session may reach the dashboard under without configuration: this machine only.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ALLOWED_HOSTS_ENV = "MPDIAG_ALLOWED_HOSTS"


def plain(text: object) -> str:
    """``text`` as a Markdown string that renders as exactly that text: no image, link, HTML, heading, list,
    emphasis, maths, colour or icon can be built from it. Line breaks are kept as hard breaks."""
    escaped = _PUNCTUATION.sub(r"\\\1", str(text))
    return escaped.replace("\r\n", "\n").replace("\n", "  \n")


def url_count(text: str | None) -> int | None:
    """A run id or step written in the URL (``?run=3``, ``?step=40``): ASCII digits of at most 12, else None.
    ``str.isdigit`` alone lets "²" and a 5,000-digit string through, on which ``int`` raises."""
    if text is None or not (text.isascii() and text.isdigit() and len(text) <= 12):
        return None
    return int(text)


def terminal_text(text: str) -> str:
    """A process's console output as ``st.code`` should show it: each line as a terminal leaves it after carriage
    returns (a progress bar's last state, not every redraw), and every other control or invisible formatting
    character (an ANSI escape's ESC, a bidi override) written out as ``\\xNN`` / ``\\uNNNN``, never acted on."""
    lines = []
    for line in str(text).replace("\r\n", "\n").split("\n"):
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
        lines.append("".join(ch.encode("unicode_escape").decode() if ch != "\t" and unicodedata.category(ch) in
                             ("Cc", "Cf", "Zl", "Zp") else ch for ch in line))
    return "\n".join(lines)


def allowed_hosts() -> tuple[str, ...]:
    """Loopback names plus those in MPDIAG_ALLOWED_HOSTS (comma-separated; ``*.example.org`` allows its
    subdomains), lower case."""
    extra = [h.strip().lower().rstrip(".") for h in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",")]
    return LOOPBACK_HOSTS + tuple(h for h in extra if h)


def host_name(host_header: str) -> str | None:
    """The host name of a ``Host`` header value (port and IPv6 brackets removed), or None when malformed."""
    try:
        parts = urlsplit(f"//{host_header.strip()}")
        _ = parts.port  # validates the port
    except ValueError:
        return None
    if parts.hostname is None or parts.username is not None or parts.password is not None or parts.path:
        return None
    return parts.hostname.lower().rstrip(".")


def host_allowed(host_header: str | None, allowed: tuple[str, ...] | None = None) -> bool:
    """Whether a session that sent ``host_header`` may see data. ``None`` (no header at all) is allowed: a
    browser always sends ``Host`` (HTTP/1.1 and WebSockets require it); only an in-process test client
    sends none."""
    if host_header is None:
        return True
    name = host_name(host_header)
    if name is None:
        return False
    for pattern in allowed if allowed is not None else allowed_hosts():
        if name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False
