"""The exceptions that end a run with one line, never a traceback."""


class UserError(Exception):
    """A problem with the user's config, flags or files; the message names it and the fix. Exit 2."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, an alert with on_alert = stop, a failed
    checkpoint save); the message names the cause. Exit 3."""
