"""Errors as a client sees them: an HTTP status and OpenAI's error fields (gRPC maps the status to
a code), with messages that carry no internals: never a traceback, a path or the input echoed
unbounded."""
from __future__ import annotations

from pydantic import ValidationError


class RequestError(Exception):
    """A request's failure as a client sees it: an HTTP status, OpenAI's error fields, a message
    with no internals. gRPC maps the status to a code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(status, message, type_, param, code)  # all in args: Ray pickles exceptions
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def __str__(self) -> str:
        return self.message

    def body(self, request_id: str | None) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          "request_id": request_id}}


def printable(text: str, limit: int = 200) -> str:
    """A client's string as we may echo it in a message: printable characters only, bounded."""
    text = text[:limit].encode("utf-8", "replace").decode("utf-8")
    return "".join(c if c.isprintable() else "?" for c in text)


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, "invalid_request_error", param)


def validation_error(e: ValidationError, field: str | None = None) -> RequestError:
    """pydantic's first error as one line: where, and what; never the input value. `field`: the
    request field the validated value came from (what `loc` is relative to)."""
    err = e.errors(include_input=False, include_url=False)[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    loc = [printable(x, 64) for x in loc]
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if field is not None and not (not loc and msg.startswith(field)):  # its own messages name it already
        loc = [field, *loc]
    if err.get("type") == "extra_forbidden":
        return bad_request(f"unknown field '{'.'.join(loc)}'", param=loc[0] if loc else None)
    param = loc[0] if loc else field
    return bad_request(f"{'.'.join(loc)}: {msg}" if loc else msg, param=param)
