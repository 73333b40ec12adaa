"""How failures are classified, and what a client is told about them.

A row's failure (its parameters, its numbers) ends that request alone. A step that raised in a
worker whose process is alive is retried row by row so the culprit fails alone. Only a dead or
hung worker (ExecutorError) ends every running request and restarts the model groups. Messages
meant for clients never carry internals; the log keeps the detail under the request id.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ErrorKind(str, Enum):
    """What a request's failure was, which decides what its client gets."""

    INVALID_REQUEST = "invalid_request"  # its own parameters or numbers: 400 / INVALID_ARGUMENT
    INTERNAL = "internal"  # our bug: 500 / INTERNAL
    UNAVAILABLE = "unavailable"  # a model worker died: 503 / UNAVAILABLE, retry it


@dataclass(frozen=True)
class RequestFailure:
    """Why a request ended in an error: its kind, and a message safe to show its client."""

    kind: ErrorKind
    message: str
    param: str | None = None  # an invalid request's field at fault (InvalidRequest.param)

    @staticmethod
    def invalid(message: str, param: str | None = None) -> "RequestFailure":
        return RequestFailure(ErrorKind.INVALID_REQUEST, message, param)


INTERNAL_ERROR = RequestFailure(ErrorKind.INTERNAL, "internal error while generating this request")
QUEUE_FAILED = RequestFailure(ErrorKind.INTERNAL, "internal error while queueing this request")
WORKER_FAILED = RequestFailure(ErrorKind.UNAVAILABLE,
                               "the model workers failed while generating this request; retry it")


class InvalidRequest(ValueError):
    """A request's own input is wrong, found before it runs: `param` names the field at fault as the
    engine spells it ("prompt", "max_tokens", "stop_token_ids", "logit_bias",
    "structured_outputs.json", ...), `reason` says what is wrong with it, and str() is the whole
    message, safe for a client. Each API maps `param` to its own field names; none parses the text."""

    def __init__(self, param: str | None, message: str, reason: str | None = None):
        super().__init__(message)
        self.param = param
        self.reason = reason if reason is not None else message

    @classmethod
    def of_field(cls, param: str, reason: str) -> "InvalidRequest":
        """An error whose message starts with the field's name: "max_tokens: must be at least 1"."""
        return cls(param, f"{param}: {reason}", reason)


class ExecutorError(RuntimeError):
    """A model group failed (a worker died or timed out); in-flight requests cannot continue."""


class StepError(RuntimeError):
    """A worker raised while running a step; its process is alive and its state is intact."""
