"""Typed errors the engine raises; the server maps them to OpenAI error objects."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as given (bad parameter, too long, unknown token id).

    `param` names the offending request field, as OpenAI's error object does.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(EngineError, LookupError):
    """A model name that is neither in the catalogue nor a local Hugging Face folder."""
