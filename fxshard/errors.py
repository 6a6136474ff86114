"""The one exception type fxshard raises for misuse."""


class FxShardError(RuntimeError):
    """A misuse of fxshard: the message says what happened and what to do instead."""
