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


def check_option_dict(d, option: str, fields: tuple[str, ...], required: tuple[str, ...]) -> None:
    """A JSON-object option as the user wrote it (``speculative_config``, ``kv_transfer_config``):
    a dict whose keys are all ``fields`` and holding every ``required`` one not None."""
    if not isinstance(d, dict):
        raise ConfigError(option, f"must be a dict (JSON object), got {type(d).__name__}")
    unknown = sorted(set(map(str, d)) - set(fields))
    if unknown:
        raise ConfigError(f"{option}.{unknown[0]}", f"unknown field; known: {', '.join(fields)}")
    for name in required:
        if d.get(name) is None:
            raise ConfigError(f"{option}.{name}", "is required")


class EngineBusyError(RuntimeError):
    """An engine operation that needs no request in flight (sleep) was asked while some run."""


class WakeUpError(RuntimeError):
    """The engine could not wake from sleep (weights or KV pool not restored); it stays asleep
    and a later wake_up may succeed."""
