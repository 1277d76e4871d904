"""The one exception type user-facing code raises for bad input."""


class FuselightError(Exception):
    """Bad input named in one line: unknown preset, bad config field, unsupported target/dtype...

    The CLI prints ``error: <message>`` and exits with code 2 on it, with no traceback.
    """
