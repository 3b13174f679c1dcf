"""Named errors. Each message says what was expected and what came."""


class ExoSplitError(Exception):
    """Base class: an error the CLI prints as one line (with a hint) instead of a traceback."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class BadCheckpoint(ExoSplitError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class PromptTooLong(ExoSplitError):
    """The prompt (plus the tokens to generate) does not fit the model's context."""


class IncompatiblePeer(ExoSplitError):
    """Two sides do not run the same model: their KV caches cannot be exchanged."""


class ProtocolError(ExoSplitError):
    """A frame on the wire broke the protocol (bad header, size, order, CRC...)."""


class PeerUnavailable(ExoSplitError):
    """A peer could not be reached, refused the request, or died mid-stream."""


class UntrustedPeer(PeerUnavailable):
    """A peer that could not prove it holds the shared token: nothing is sent to it."""


class AuthError(ExoSplitError):
    """A request carried no token or the wrong one."""


class PeerBusy(PeerUnavailable):
    """A peer answered 503: its queue is full. `retry_after` is its Retry-After, in seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.retry_after = retry_after


class BadMessages(ExoSplitError, ValueError):
    """Chat messages that cannot be rendered. `param` names the offending field (API errors)."""

    def __init__(self, message: str, *, param: str = "messages", hint: str | None = None):
        super().__init__(message, hint=hint)
        self.param = param
