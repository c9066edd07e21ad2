"""One error type the CLI knows how to print: one line of what went wrong, one of the fix."""

from __future__ import annotations


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


class JobFailed(ApplianceError):
    """The training job ran and failed; exit_code is the job's."""
