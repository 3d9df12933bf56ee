"""Secrets (tokens, API keys) from a file or the environment, never from argv.

A command line is readable by every local user (``ps``, ``/proc/PID/cmdline``) and
lands in vLLM's "non-default args" log line, so kvpath's own commands and the
processes it starts take secrets from a file (``--*-file PATH``, ``*_file`` knobs) or
an environment variable. One reader for all of them, so every caller reports a bad
file the same way: an error naming the field, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_SECRET_BYTES = 4096  # a token is tens of bytes: a larger file is a wrong path


class CredentialError(ValueError):
    """A secret named by the operator that cannot be read (the message names the field)."""


def read_secret_file(path: str | os.PathLike[str], field: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped). Empty, unreadable or
    oversized files are a :class:`CredentialError` naming ``field``."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise CredentialError(f"{field}: cannot read {str(p)!r}: {e.strerror or e}") from None
    if len(raw) > MAX_SECRET_BYTES:
        raise CredentialError(f"{field}: {str(p)!r} is over {MAX_SECRET_BYTES} bytes: not a token file")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CredentialError(f"{field}: {str(p)!r} is not UTF-8 text") from None
    if not text:
        raise CredentialError(f"{field}: {str(p)!r} is empty")
    if any(c in text for c in "\r\n\x00"):
        raise CredentialError(f"{field}: {str(p)!r} holds more than one line")
    return text


def load_secret(field: str, path: str | os.PathLike[str] | None = None, env: str | None = None,
                environ: dict[str, str] | None = None) -> str | None:
    """The secret from ``path`` when given, else from the environment variable ``env``
    (empty counts as unset), else None. ``field`` names the option in errors."""
    if path:
        return read_secret_file(path, field)
    if env:
        value = (os.environ if environ is None else environ).get(env, "").strip()
        return value or None
    return None


def header_safe(value: str, spaces: bool = False) -> bool:
    """Can ``value`` travel as a bearer credential in an HTTP header: printable ASCII
    (Starlette reads header bytes back as latin-1, vLLM compares UTF-8), and one word
    unless ``spaces``."""
    return value.isascii() and value.isprintable() and (spaces or " " not in value)


def write_secret_file(path: str | os.PathLike[str], secret: str) -> Path:
    """Write ``secret`` to ``path`` readable by its owner only (0600 from creation)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(p, 0o600)
    return p


def secret_arg(args: argparse.Namespace, prog: str, file_opt: str, env: str, argv_opt: str = "") -> str | None:
    """A token from ``file_opt`` (a file), else from the deprecated ``argv_opt`` (the
    token itself on the command line, with a warning), else from the environment
    variable ``env``; None when none is given. A bad file is a ``kvpath PROG: error``
    naming the option, never a traceback; the token itself is never logged."""
    dest = lambda opt: opt.lstrip("-").replace("-", "_")  # noqa: E731
    path = getattr(args, dest(file_opt), None)
    literal = getattr(args, dest(argv_opt), None) if argv_opt else None
    if path and literal:
        raise SystemExit(f"kvpath {prog}: error: give {file_opt} or the deprecated {argv_opt}, not both")
    if literal:
        logger.warning("%s is deprecated: a command line is readable by every local user (ps, /proc/PID/cmdline); "
                       "use %s PATH (a 0600 file) or the %s environment variable", argv_opt, file_opt, env)
        token, source = literal, argv_opt
    else:
        try:
            token, source = load_secret(file_opt, path, env), file_opt if path else f"${env}"
        except CredentialError as e:
            raise SystemExit(f"kvpath {prog}: error: {e}") from None
    if token is not None and not header_safe(token):
        # it travels in an HTTP header: anything else could never match, or never be sent
        raise SystemExit(f"kvpath {prog}: error: {source}: a token must be one word of printable ASCII")
    return token
