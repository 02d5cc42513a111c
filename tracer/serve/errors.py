"""Errors the server answers with, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` and an HTTP status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..runtime.options import OptionError


@dataclass
class APIError(Exception):
    """A request the server answers with an error (raised anywhere before the
    response starts; the app turns it into the JSON body and status)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None
    retry_after: Optional[int] = None  # seconds, for 503

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_option(e: OptionError, param: Optional[str] = None) -> APIError:
    """A 400 for an option the runtime's checks refused: their message as it is,
    the parameter they name (or ``param``, the client's name for it) and their code."""
    return APIError(400, str(e), "invalid_request_error", param or e.param, e.code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "unsupported_parameter")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist: this server serves {served!r} (GET /v1/models)",
                    "invalid_request_error", "model", "model_not_found")


def queue_full(depth: int, retry_after: int = 1) -> APIError:
    return APIError(503, f"the server is busy: {depth} requests are waiting, the most it queues; retry shortly",
                    "server_busy", None, "queue_full", retry_after)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "unavailable", 5)


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"the request ran past the server's timeout of {seconds:g} s and was cancelled",
                    "timeout_error", None, "timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes, --max-request-bytes): "
                         "send a shorter prompt", "invalid_request_error", None, "request_too_large")


def too_deep(limit: int) -> APIError:
    return APIError(400, f"the request body nests JSON arrays and objects more than {limit} levels deep",
                    "invalid_request_error", None, "json_too_deep")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key")


def shutting_down(retry_after: int = 5) -> APIError:
    return APIError(503, "the server is shutting down: retry shortly (or on another server)", "server_error", None,
                    "shutting_down", retry_after)
