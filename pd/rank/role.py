"""What the rank loop (pd/rank/worker.py) and its P/D roles (pd/rank/prefill_role.py, pd/rank/decode_role.py) share: the role
interface, and the one way a request message becomes an engine request."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from engine.errors import InvalidRequestError
from engine.faults import raise_if_fatal
from pd.messages import AddRequest, Message, Prefill, RequestRejected

if TYPE_CHECKING:  # NOTE: the rank process imports the engine inside main()'s try (a failure is a RankFatal)
    from engine.engine import LLMEngine
    from engine.request import RequestOutput


log = logging.getLogger(__name__)

ADMISSION_FAILED = "the request could not be admitted: an internal error (the server's log has it under the request's id)"


def add_request(
    engine: LLMEngine, msg: AddRequest | Prefill, *, prefill_only: bool = False, seed: int | None = None
) -> Exception | None:
    """Queues the request msg carries (the rank loop's AddRequest, the PE's Prefill). Returns why it was
    not queued (admission_error's), which each caller answers in its own message, or None once it is."""
    try:
        engine.add_request(
            msg.request_id,
            list(msg.prompt_token_ids),
            msg.params,
            use_prefix_cache=msg.use_prefix_cache,
            prefill_only=prefill_only,
            seed=seed,
        )
    except Exception as e:
        return admission_error(engine, msg.request_id, e)
    return None


def admission_error(engine: LLMEngine, request_id: str, error: Exception) -> Exception:
    """What admitting request_id raised, made safe to answer: the request's own fault
    (InvalidRequestError) as it is; anything else logged under the request's id, with whatever the
    request left behind freed. Only a fatal error (engine/faults.py) propagates, and the rank exits."""
    if not isinstance(error, InvalidRequestError):
        raise_if_fatal(error)
        log.error("request %s: admission failed", request_id, exc_info=error)
        engine.abort(request_id)
    return error


def rejection(request_id: str, error: Exception) -> RequestRejected:
    """The answer to a request admission_error refused: a 400 naming the field, or a generic 500."""
    if isinstance(error, InvalidRequestError):
        return RequestRejected(request_id, str(error), error.param)
    return RequestRejected(request_id, ADMISSION_FAILED, is_internal=True)


class RankRole(Protocol):
    """What a P/D role adds to the rank loop. Every method runs on the engine thread."""

    wake: zmq.Socket  # readable when the role's threads have news for tick()

    def handle(self, msg: Message) -> bool:
        """Takes a message the role owns (True), or does its bookkeeping and lets the loop apply it."""
        ...

    def tick(self) -> None:
        """Applies what the role's threads queued; expires what is overdue."""
        ...

    def on_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The engine step's outputs that go to the HTTP process."""
        ...

    def poll_timeout_s(self) -> float:
        """How long the idle loop may block before tick() must run again."""
        ...

    def stats(self) -> dict[str, Any]:
        """Numbers the role adds to the rank's stats (exported as pdserve_engine_<name>)."""
        ...

    def close(self) -> None: ...
