"""OpenAI's error body: `{"error": {"message", "type", "param", "code"}}` with its status codes."""

from __future__ import annotations

from typing import Any


class ServingError(Exception):
    """A request the endpoint refuses; becomes OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServingError:
    return ServingError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, why: str) -> ServingError:
    # OpenAI answers an unknown model with 404 and code model_not_found
    return ServingError(404, f"The model `{model}` does not exist: {why}", "invalid_request_error", "model",
                        "model_not_found")
