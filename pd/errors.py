"""OpenAI-shaped API errors: what the HTTP layer raises and how it is written to the client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pd.messages import RequestRejected


class ApiError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  # sent with the error (Retry-After, Connection: close)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="service_unavailable")


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def unexpected() -> ApiError:
    """The answer to an exception the server did not expect: a 500 that says nothing of it (the caller
    logs it, and the log line carries the request's id)."""
    return internal("internal error (the server's log has it under the request's id)")


def rejected(ev: RequestRejected) -> ApiError:
    """The error a rank's refusal of a request answers with: a 400 for the request's fault, else a 500."""
    return internal(ev.message) if ev.is_internal else bad_request(ev.message, ev.param)
