"""The exceptions of flashmetal: one base class, one subclass per library
status (FMStatus of flashmetal.h), each also a built-in exception so
``except ValueError`` keeps working. Every error carries the public function
it came from (``.op``), the argument at fault (``.argument``; None when the
error is not about one argument) and the library status (``.status``; None
when Python raised it before calling the library)."""
from __future__ import annotations


class Error(Exception):
    """Base class of every flashmetal error."""

    def __init__(self, op: str, message: str, status: int | None = None, argument: str | None = None) -> None:
        super().__init__(f"{op}: {message}" if op else message)
        self.op = op
        #: What is wrong, without the op: the library's FMError.message or
        #: the text Python raised, so no caller has to cut it out of str(e).
        self.message = message
        self.status = status
        self.argument = argument


class InvalidValueError(Error, ValueError):
    """A bad shape, size, length or option (FM_ERROR_VALUE)."""


class InvalidTypeError(Error, TypeError):
    """A bad dtype or argument type (FM_ERROR_TYPE)."""


class BackendError(Error, RuntimeError):
    """A backend could not be created or failed to run a kernel (FM_ERROR_BACKEND)."""


class InternalError(Error, RuntimeError):
    """A bug in flashmetal: please report it (FM_ERROR_INTERNAL)."""


class UnsupportedFeatureError(Error, NotImplementedError):
    """A feature flashmetal does not implement for the call (dropout masks,
    rotary embedding over codes, sinks no kernel can apply to it;
    FM_ERROR_UNSUPPORTED); raised before any work runs."""


#: The exception of each FMStatus name; a new status is one more line here.
STATUS_ERRORS: dict[str, type[Error]] = {
    "FM_ERROR_VALUE": InvalidValueError,
    "FM_ERROR_TYPE": InvalidTypeError,
    "FM_ERROR_BACKEND": BackendError,
    "FM_ERROR_INTERNAL": InternalError,
    "FM_ERROR_UNSUPPORTED": UnsupportedFeatureError,
}
