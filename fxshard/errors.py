"""The one exception type fxshard raises for misuse."""

from fxshard.torch_compat import ShortenTraceback


class FxShardError(ShortenTraceback):
    """A misuse of fxshard: the message says what happened and what to do instead.

    It derives (through Dynamo's ``ShortenTraceback``) from ``RuntimeError``. The Dynamo base is what lets an error
    raised while ``torch.compile`` runs the fxshard backend reach the user as itself rather than wrapped in
    ``BackendCompilerFailed``.
    """

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)
