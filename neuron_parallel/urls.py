"""URLs a credential travels to: compared by the server they reach, and written without the
parts that may be secret.

A Hub token goes with every request to the Hub's endpoint, and a chat webhook's URL is itself its
credential (its path holds the key). Such a URL must be ``https://``, or ``http://`` to this
machine (:func:`encrypted_or_local`), and an error or a log line names it by scheme and host only
(:func:`redact_url`). :func:`base_url` is the form two base URLs are compared in.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

__all__ = ["LOOPBACK_HOSTS", "PUBLIC_HUB", "base_url", "encrypted_or_local", "is_loopback", "redact_url"]

PUBLIC_HUB = "https://huggingface.co"
"""The public Hugging Face Hub: huggingface_hub's endpoint when ``HF_ENDPOINT`` is unset."""
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
"""Host names that reach this machine only."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _split(url: str) -> tuple[SplitResult, str, int | None] | None:
    """The parts, host and port of an http(s) URL that names a host; None for anything else."""
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port  # port: ValueError when not a number in 0..65535
    except ValueError:
        return None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not host:
        return None
    return parts, host, port


def _netloc(scheme: str, host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None or port == _DEFAULT_PORTS[scheme] else f"{shown}:{port}"


def redact_url(url: str) -> str:
    """``url`` as an error or a log may show it: scheme and host (and a port that is not the
    default), with ``/…`` standing for a path, query or fragment; ``…`` for what is not an http(s)
    URL of a host. User info is never shown."""
    split = _split(url)
    if split is None:
        return "…"
    parts, host, port = split
    scheme = parts.scheme.lower()
    rest = "/…" if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{scheme}://{_netloc(scheme, host, port)}{rest}"


def base_url(url: str) -> str:
    """``url`` in the form two base URLs are compared in: lower-case scheme and host, the port
    only when it is not the scheme's default, no trailing slash. Raises ``ValueError`` saying
    what is wrong (not showing ``url``: the caller knows whether it may) for what is not an
    ``http(s)://host[:port][/path]``: user info, a query or a fragment have no place in a base URL."""
    split = _split(url)
    if split is None:
        raise ValueError("is not an http:// or https:// URL of a host (with a valid port)")
    parts, host, port = split
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError("is not a base URL: it carries user info, a query or a fragment")
    scheme = parts.scheme.lower()
    return f"{scheme}://{_netloc(scheme, host, port)}{parts.path.rstrip('/')}"


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine by one of :data:`LOOPBACK_HOSTS`."""
    split = _split(url)
    return split is not None and split[1] in LOOPBACK_HOSTS


def encrypted_or_local(url: str) -> bool:
    """Whether a credential sent to ``url`` stays out of others' sight: ``https://``, or
    ``http://`` to this machine."""
    split = _split(url)
    if split is None:
        return False
    scheme = split[0].scheme.lower()
    return scheme == "https" or (scheme == "http" and split[1] in LOOPBACK_HOSTS)
