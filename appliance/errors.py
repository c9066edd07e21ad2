"""One error type the CLI knows how to print: one line of what went wrong, one of the fix."""

from __future__ import annotations

import re


class ApplianceError(Exception):
    """An error a user can act on. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        """One line, always (a path or name with a newline in it is shown escaped)."""
        text = self.message if not self.fix else f"{self.message} (fix: {self.fix})"
        return text.replace("\r", "\\r").replace("\n", "\\n")


class SpecError(ApplianceError):
    """The run spec is invalid. Exit code 2, like a usage error."""

    exit_code = 2


class NoHosts(ApplianceError):
    """Blazar has not enough hosts of the node type for the lease's window (NotEnoughHostsAvailable)."""


class NoSUs(ApplianceError):
    """Chameleon's portal refused the lease: the project's SU balance is below what it would cost."""


class Unanswered(ApplianceError):
    """The cloud did not say whether it made what it was asked for (a timeout, a reset, a 502-504): what was
    asked for may exist, and is looked for rather than forgotten."""


class Unavailable(ApplianceError):
    """The cloud did not answer a read or a delete (a 5xx, a timeout, a refused connection) though it was asked again
    with back-off: not an answer ("not there" least of all); the same step later may well succeed."""


class Unreachable(ApplianceError):
    """A node did not answer SSH (a refusal, a reset, a close before its banner, no banner or no route in time): down,
    or the network between is; not a refusal of the key or the host key, and the same step later may well succeed."""


class JobFailed(ApplianceError):
    """The training job ran and failed; exit_code is the job's."""


def _chain_text(e: BaseException | str) -> str:
    """The texts of an exception and of the ones it was raised from (botocore keeps the socket's error in
    ``kwargs['error']``)."""
    texts, seen = [], set()
    while isinstance(e, BaseException) and id(e) not in seen:
        seen.add(id(e))
        texts.append(str(e))
        e = e.__cause__ or e.__context__ or getattr(e, "kwargs", {}).get("error")
    return "\n".join(texts) if texts else str(e)


def untrusted_certificate(e: BaseException | str) -> str | None:
    """Why the server's certificate was refused (OpenSSL's words: "self-signed certificate", "unable to get local
    issuer certificate", "Hostname mismatch, ..."), when that is what failed, in the exception or anything it was
    raised from (ssl's SSLCertVerificationError, as requests, urllib3 and botocore wrap it); else None. Not a
    failure that goes away when asked again."""
    m = re.search(r"certificate verify failed: ?([^\n]*)", _chain_text(e), re.IGNORECASE)
    if not m:
        return None
    why = re.split(r" \(_ssl\.c:\d+\)", m.group(1))[0].rstrip("'\")] ")
    return why or "certificate verify failed"


def socket_reason(e: BaseException | str) -> str:
    """Why a connection failed, from an exception (and the ones it was raised from) or its text: the socket's own
    words ("Connection refused", "Name or service not known", "timed out"), not the chain of HTTP libraries
    wrapped around them (botocore's EndpointConnectionError names the socket's error only in its cause)."""
    text = _chain_text(e)
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]\n]+)", text)
    if m:
        return m.group(1).strip()
    return "timed out" if "timed out" in text.lower() else (text.strip().splitlines() or ["no answer"])[0][:160]
