"""The errors of agreement among ranks: one failed to answer, or answered too late.

Every message names the rank and host that raises it and, for a timeout, the config key
that bounds the wait, so the user knows which rank to look at and which knob to turn.
"""

from spmd.errors import SpmdError


class AgreementError(SpmdError):
    """Ranks could not agree: a vote could not be posted, or the channel is missing."""


class AgreementTimeout(AgreementError):
    """A rank waited longer than its configured timeout for the others."""
