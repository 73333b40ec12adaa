"""How failures are classified, and what a client is told about them.

A row's failure (its parameters, its numbers) ends that request alone. A step that raised in a
worker whose process is alive is retried row by row so the culprit fails alone. Only a dead or
hung worker (ExecutorError) ends every running request and restarts the model groups. Messages
meant for clients never carry internals; the log keeps the detail under the request id.
"""
from __future__ import annotations

INTERNAL_ERROR = "internal error while generating this request"


class ExecutorError(RuntimeError):
    """A model group failed (a worker died or timed out); in-flight requests cannot continue."""


class StepError(RuntimeError):
    """A worker raised while running a step; its process is alive and its state is intact."""


WORKER_FAILED = "the model workers failed while generating this request; retry it"


def error_kind(message: str) -> str:
    """'internal' (our bug), 'unavailable' (a worker died: retry) or 'invalid_request' (its own numbers)."""
    if message == INTERNAL_ERROR or message.startswith("internal error"):
        return "internal"
    if message == WORKER_FAILED:
        return "unavailable"
    return "invalid_request"

