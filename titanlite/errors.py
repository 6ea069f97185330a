"""The exceptions that end a run with one line, never a traceback."""


class UserError(Exception):
    """A problem with the user's config, flags or files; the message names it and the fix. Exit 2."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, an alert with on_alert = stop, a failed
    checkpoint save); the message names the cause. Exit 3."""


class LostRank(Exception):
    """A collective waited longer than comm.timeout_s or lost a peer; the message names the
    ranks that did not arrive (titanlite.distributed.liveness). Exit 4: a restart may help."""


def first_line(e: BaseException) -> str:
    """An exception's first message line, for one-line errors (its type when it has no message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
