"""Coordinator: the state the HTTP handlers share. The model's tokenizer and chat template, the engine
ranks, the routing policy and the metrics, plus the checks that need them (model name, context length)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import zmq.asyncio
from aiohttp import web

from pd.chat.renderer import PromptRenderer
from pd.config import ServerConfig
from pd.disagg.decode_path import DecodePath
from pd.disagg.metrics import ClusterMetrics
from pd.errors import ApiError, bad_request, model_not_found, unavailable
from pd.frontend.metrics import RankSnapshot, ServerMetrics
from pd.frontend.router import make_router
from pd.frontend.sampling_defaults import sampling_defaults, with_defaults
from pd.frontend.vllm_metrics import CacheConfigInfo
from pd.http.io import read_json
from pd.kv_events.publisher import offset_endpoint
from pd.lifecycle import Admission
from pd.rank.client import RankClient, RankGroup, RankState
from pd.rank.restart_policy import RestartPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
RENDER_THREADS = 2  # chat rendering and tokenization run here, off the event loop
# The render threads run at this nice value (Linux sets it per thread): a maximal prompt's tokenization
# then takes only the CPU the engine ranks leave. At the same priority, on a host with as many cores as
# a CPU rank's threads, it stalled every decode step of the ranks' other streams for the whole render
# (the rank's OpenMP threads wait at each barrier for the one that lost its core).
RENDER_NICE = 10


def _lower_priority() -> None:
    """The render thread's initializer: below the ranks (where the OS allows it; else unchanged)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RENDER_NICE)


def load_tokenizer(model: str) -> Any:
    """The checkpoint's tokenizer (the HTTP process renders and counts tokens; the ranks only see ids)."""
    # tokenizers' own thread pool would run a long prompt on threads of normal priority: the render
    # threads (below) tokenize it themselves instead, still without holding the GIL.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from engine.checkpoints import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def load_sampling_defaults(cfg: ServerConfig, folder: Path) -> dict[str, Any]:
    """The sampling defaults --generation-config gives (pd/frontend/sampling_defaults.py) for the
    checkpoint in folder, logged."""
    defaults = sampling_defaults(cfg.generation_config, folder)
    if defaults:
        log.info(
            "sampling defaults of requests that do not set them, from generation_config.json: %s "
            "(--generation-config vllm: none)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults


class Coordinator:
    def __init__(self, cfg: ServerConfig, tokenizer: Any = None) -> None:
        """tokenizer: None until load_tokenizer (the server loads it while its ranks start)."""
        self.cfg = cfg
        self._renderer = None if tokenizer is None else self._make_renderer(tokenizer)
        self.router = make_router(cfg.routing, self.kv_event_streams(), self._events_token())
        cache = CacheConfigInfo(cfg.engine.block_size, cfg.engine.gpu_memory_utilization, cfg.engine.enable_prefix_caching)
        self.metrics = ServerMetrics(self.snapshot, cfg.model_name, cache)
        for i in range(cfg.dp):
            for reason in self.router.reasons:
                self.metrics.rank_selected.labels(str(i), reason)
        self.metrics.kv_choice = self.router.kv
        self.cluster_metrics = ClusterMetrics(self.metrics.registry, cfg.model_name) if cfg.is_pd else None
        self.pd: DecodePath | None = None  # the CE's P/D generation path (set by start)
        self.ranks: list[RankClient] = []
        self.created = int(time.time())
        # --generation-config: the values of sampling fields a request leaves out (load_tokenizer reads them)
        self.sampling_defaults: dict[str, Any] = {}
        self.admission = Admission()
        self.inflight_ids: set[str] = set()  # the HTTP requests' ids in flight (a duplicate gets 409)
        self._pool = ThreadPoolExecutor(
            RENDER_THREADS, thread_name_prefix="render", initializer=_lower_priority
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._socket_dir: str | None = None

    @property
    def model_name(self) -> str:
        return self.cfg.model_name

    def _events_token(self) -> bytes | None:
        """The cluster token, where --routing kv-aware reads a stream bound off loopback (its CURVE keys;
        the ranks refuse to publish there without it); else None."""
        if self.cfg.routing != "kv-aware":
            return None
        from transfer.auth import load_token

        try:
            return load_token(token_file=self.cfg.cluster_token_file or None)
        except (ValueError, OSError):
            return None

    def _make_renderer(self, tokenizer: Any) -> PromptRenderer:
        template = Path(self.cfg.chat_template).read_text() if self.cfg.chat_template else None
        return PromptRenderer(tokenizer, template)

    async def load_tokenizer(self) -> None:
        """Loads the model's tokenizer and chat template (raises ModelNotFoundError, OSError, ValueError)."""
        from engine.checkpoints import resolve_model

        folder = await asyncio.to_thread(resolve_model, self.cfg.engine.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, str(folder))
        self.sampling_defaults = await asyncio.to_thread(load_sampling_defaults, self.cfg, folder)
        self._renderer = await asyncio.to_thread(self._make_renderer, tokenizer)

    def with_sampling_defaults(self, body: Any) -> Any:
        """A request's JSON body with --generation-config's values of the sampling fields it leaves out."""
        return with_defaults(body, self.sampling_defaults)

    @property
    def renderer(self) -> PromptRenderer:
        assert self._renderer is not None, "the server serves requests only once the tokenizer is loaded"
        return self._renderer

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    # ---- ranks --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts every rank and waits until all are ready; raises if one fails to start."""
        self._ctx = zmq.asyncio.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="pdserve-")
        if self.cfg.role == "ce":
            from pd.disagg.prefill_pool import PrefillPool
            from transfer.auth import load_token

            token = load_token(token_file=self.cfg.cluster_token_file or None)
            cm = self.cluster_metrics
            assert cm is not None
            pool = PrefillPool(
                self.cfg.prefill_url,
                token,
                self.cfg.prefill_timeout_s,
                cm,
                routing=self.cfg.pe_routing,
                load_slack=self.cfg.pe_load_slack,
                dns_refresh_s=self.cfg.pe_dns_refresh_s,
                ssl_ca_certs=self.cfg.ssl_ca_certs,
                block_size=self.cfg.engine.block_size,
                kv_load_weight=self.cfg.kv_load_weight,
            )
            self.pd = DecodePath(self.cfg, pool, cm)
            await pool.start()
        group = RankGroup("127.0.0.1", RestartPolicy.of(self.cfg)) if self.cfg.ep > 1 else None
        self.ranks = [
            RankClient(
                i,
                self.cfg.dp,
                self.cfg.engine,
                self._socket_dir,
                self._ctx,
                self.cfg.role,
                self.cfg.role_config(i) if self.cfg.is_pd else None,
                RestartPolicy.of(self.cfg),
                group,
                self.cfg.log_format,
                self.cfg.tp,
            )
            for i in range(self.cfg.dp)
        ]
        for r in self.ranks:
            await r.start()
        await asyncio.gather(*(r.wait_ready(self.cfg.rank_start_timeout_s) for r in self.ranks))
        lens = {r.info.max_model_len for r in self.ranks if r.info}
        if len(lens) != 1:
            raise RuntimeError(f"ranks disagree on max_model_len: {sorted(lens)}")
        self.metrics.vllm.size_token_histograms(lens.pop())
        self.router.sync(self.ranks)  # kv-aware: every rank's stream is read from here on

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self.router.stop()
        if self.pd is not None:
            await self.pd.pool.stop()
        await asyncio.gather(*(r.stop() for r in self.ranks), return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    @contextlib.contextmanager
    def pick_rank(self, affinity_key: str | None, token_ids: list[int]) -> Iterator[RankClient]:
        """The rank for a request (its conversation key, its prompt's token ids), counted there while the
        block runs (kv-aware: its work in the rank's load); 503 while no rank is up."""
        choice = self.router.pick(affinity_key, self.ranks, token_ids)
        if choice is None:
            if any(r.state is RankState.STARTING and r.num_restarts == 0 for r in self.ranks):
                raise unavailable("the server is starting: the engines are not ready yet")
            raise unavailable("no engine rank is up")
        rank, reason = choice
        assert isinstance(rank, RankClient)
        self.metrics.rank_selected.labels(str(rank.index), reason).inc()
        with self.router.hold(rank, token_ids):
            yield rank

    # ---- serving one HTTP request ----------------------------------------------------------------

    async def read_json(self, request: web.Request) -> Any:
        """The request's JSON body, within --max-body-bytes and --body-timeout."""
        return await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the render threads (templates, tokenizers): a long prompt does not stall the
        event loop, so other streams keep their pace. The request's log context goes with it."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, fn, *args)

    @contextlib.contextmanager
    def claim(self, request_id: str) -> Iterator[None]:
        """Holds a request id while its request is served; one already in flight is a 409."""
        if request_id in self.inflight_ids:
            raise ApiError(
                409, f"a request with id {request_id!r} is in flight already", code="duplicate_request_id"
            )
        self.inflight_ids.add(request_id)
        try:
            yield
        finally:
            self.inflight_ids.discard(request_id)

    def snapshot(self) -> list[RankSnapshot]:
        return [
            RankSnapshot(
                r.index, r.is_up, r.num_inflight, dict(r.stats), r.num_restarts, r.info.max_model_len if r.info else 0
            )
            for r in self.ranks
        ]

    def kv_event_streams(self) -> list[dict[str, Any]]:
        """Each rank's KV event stream (--kv-events-config), for a consumer to subscribe to."""
        cfg = self.cfg.engine.kv_events()
        if cfg is None or not cfg.publishes:
            return []
        return [
            {
                "rank": i,
                "endpoint": offset_endpoint(cfg.endpoint, i),
                "replay_endpoint": None if cfg.replay_endpoint is None else offset_endpoint(cfg.replay_endpoint, i),
                "topic": cfg.topic,
                "block_size": self.cfg.engine.block_size,
            }
            for i in range(self.cfg.dp)
        ]

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health: 200 while a rank is up (and the server is not draining), with every rank's state.
        status: ok | degraded (a rank down, or on a CE a PE not up, without local fallback) |
        starting | down | draining. A CE lists its PEs (state, prefills in flight, last error)."""
        states = [r.state for r in self.ranks]
        num_up = states.count(RankState.UP)
        if self.admission.is_draining:
            status = "draining"
        elif num_up == len(states) and states:
            status = "ok"
        elif num_up:
            status = "degraded"
        elif any(s in (RankState.STARTING, RankState.RESTARTING) for s in states) or not states:
            status = "starting"
        else:
            status = "down"
        body: dict[str, Any] = {
            "status": status,
            "role": self.cfg.role,
            "model": self.model_name,
            "ranks": [r.describe() for r in self.ranks],
        }
        streams = self.kv_event_streams()
        if streams:
            body["kv_events"] = streams
        if self.router.kv is not None:
            body["rank_kv_index"] = self.router.kv.describe()
        if self.pd is not None:
            pool = self.pd.pool
            body["prefill_engines"] = pool.describe()
            if pool.kv is not None:
                body["kv_index"] = pool.kv.describe()
            if pool.dns_error:
                body["prefill_dns_error"] = pool.dns_error
            if status == "ok" and not pool.all_up and not self.cfg.fallback_local_prefill:
                body["status"] = "degraded"  # every CE still serves while one PE is up
        if self.admission.is_draining:
            body["num_inflight"] = self.admission.num_inflight
        return (200 if num_up and not self.admission.is_draining else 503), body

    def readiness(self) -> tuple[bool, str]:
        """/health/ready: whether a request can be served now, and if not, why."""
        if self.admission.is_draining:
            return False, "draining"
        if not any(r.is_up for r in self.ranks):
            return False, "no engine rank is up"
        if self.pd is not None and not self.pd.pool.any_up and not self.cfg.fallback_local_prefill:
            return False, "no prefill engine is reachable"
        return True, "ready"

    # ---- request checks -----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        for r in self.ranks:
            if r.info is not None:
                return r.info.max_model_len
        raise unavailable("the server is starting: the engines are not ready yet")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.cfg.engine.model):
            raise model_not_found(name)

    def max_tokens_for(
        self, prompt_len: int, requested: int | None, param: str, default: int | None = None
    ) -> int:
        """max_tokens that fits the context: the request's own, else `default`, else what is left."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and your {param} has {prompt_len} tokens. "
                f"Please shorten the {param}.",
                param,
                code="context_length_exceeded",
            )
        if requested is None:
            return min(default, limit - prompt_len) if default is not None else limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} in the completion). "
                f"Please reduce the length of the {param} or max_tokens.",
                param,
                code="context_length_exceeded",
            )
        return requested

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one coordinator per process)
    def token_text(self, token_id: int) -> str:
        with contextlib.suppress(Exception):
            return str(self.tokenizer.decode([token_id]))
        return ""
