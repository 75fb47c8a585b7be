"""Errors every layer may raise for the command line to print (agent.cli re-exports them)."""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; printed as one line, exit code `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
