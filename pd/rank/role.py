"""What the rank loop (pd/rank/worker.py) and its P/D roles (pd/rank/prefill_role.py, pd/rank/decode_role.py) share: the role
interface, and the one way a request message becomes an engine request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import zmq

from engine.errors import InvalidRequestError
from pd.messages import AddRequest, Message, Prefill

if TYPE_CHECKING:  # NOTE: the rank process imports the engine inside main()'s try (a failure is a RankFatal)
    from engine.engine import LLMEngine
    from engine.request import RequestOutput


def add_request(
    engine: LLMEngine, msg: AddRequest | Prefill, *, prefill_only: bool = False, seed: int | None = None
) -> InvalidRequestError | None:
    """Queues the request msg carries (the rank loop's AddRequest, the PE's Prefill). Returns the
    engine's refusal, which each caller answers in its own message, or None once it is queued."""
    try:
        engine.add_request(
            msg.request_id,
            list(msg.prompt_token_ids),
            msg.params,
            use_prefix_cache=msg.use_prefix_cache,
            prefill_only=prefill_only,
            seed=seed,
        )
    except InvalidRequestError as e:
        return e
    return None


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
