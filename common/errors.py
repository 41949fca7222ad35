"""Errors a user can cause. Each names the bad thing; the CLI and servers show the message,
never a traceback. Internal faults stay ordinary exceptions."""


# How a decode worker words a request it ended because its KV never arrived (the sender died,
# the link was cut, a frame was refused): the worker itself is sound, so the coordinator
# moves such a request to another prefill worker (coordinator/request_flow.py).
KV_TRANSFER_FAILED = "KV transfer failed"


class TandemError(Exception):
    """Base class for errors caused by user input or the environment."""


class ModelNotFoundError(TandemError):
    """A model name or path that resolves to nothing."""


class ModelNameError(TandemError):
    """A model name the store cannot take (bad characters, reserved, or already another kind)."""


class ModelFormatError(TandemError):
    """A file that is missing, truncated, or not a model in a format we read."""


class UnsupportedModelError(TandemError):
    """A well-formed model we cannot run: unknown architecture or quantization type."""


class ContextLengthError(TandemError):
    """A prompt (plus the tokens asked for) that does not fit the context window."""


class InvalidOptionError(TandemError):
    """A sampling or request option of the wrong type or out of range."""


class ChatTemplateError(InvalidOptionError):
    """A chat template that does not parse, or that fails or refuses to render the given messages."""


class SamplingError(TandemError):
    """A request whose logits gave no distribution to draw from (non-finite or all-zero
    probabilities). The request ends with this error; the rest of its batch goes on."""


class ResidencyError(TandemError):
    """The engine's weights are dropped (keep_alive expired) and the work needs them, or they
    cannot be dropped now because requests are open; a worker answers FAILED_PRECONDITION."""
