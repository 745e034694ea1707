"""Errors kvserve raises for bad input. All are ValueErrors, so callers can catch them broadly."""


class InvalidRequestError(ValueError):
    """A request or parameter is out of range. ``field`` names the offending parameter; ``code``
    is OpenAI's error code where it defines one (``context_length_exceeded``)."""

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.code = field, message, code


class ModelLoadError(ValueError):
    """A model path, file or config that kvserve cannot load; the message names the file."""


class ConfigError(ValueError):
    """An engine option that is out of range; the message names the option."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


class EngineBusyError(RuntimeError):
    """An engine operation that needs no request in flight (sleep) was asked while some run."""


class WakeUpError(RuntimeError):
    """The engine could not wake from sleep (weights or KV pool not restored); it stays asleep
    and a later wake_up may succeed."""
