"""The one exception type for bad input: it is printed as a single line, never a traceback."""


class UserError(Exception):
    """A problem with the user's config, flags or files; the message names it and the fix."""
