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

    @staticmethod
    def invalid(message: str) -> "RequestFailure":
        return RequestFailure(ErrorKind.INVALID_REQUEST, message)


INTERNAL_ERROR = RequestFailure(ErrorKind.INTERNAL, "internal error while generating this request")
QUEUE_FAILED = RequestFailure(ErrorKind.INTERNAL, "internal error while queueing this request")
WORKER_FAILED = RequestFailure(ErrorKind.UNAVAILABLE,
                               "the model workers failed while generating this request; retry it")


class ExecutorError(RuntimeError):
    """A model group failed (a worker died or timed out); in-flight requests cannot continue."""


class StepError(RuntimeError):
    """A worker raised while running a step; its process is alive and its state is intact."""
