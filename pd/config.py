"""ServerConfig: everything `python -m pd.server` is told on its command line; RoleConfig: what a P/D
rank is told about its role.

Each setting is declared once, as a field with its default, type and help: the HTTP, coordinator and
P/D role settings here, the engine's in EngineConfig (engine/config.py), the KV transfer's in
TransferConfig (transfer/config.py), nested as `engine` and `transfer`. The flags are generated from
the fields (pd/flags.py); a rank receives its EngineConfig and RoleConfig as JSON encoded by the
codec (engine/codec.py), which refuses an unknown key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from engine.config import MAX_DEFAULT_MODEL_LEN, EngineConfig
from pd.flags import add_config_flag, flags, from_flags, parse_args, parser_for
from pd.kv_transfer_config import kv_transfer_settings
from transfer.config import TransferConfig
from transfer.transports import names_where

DEFAULT_PORT = 8888
DEFAULT_PE_PORT = 8889
DEFAULT_KV_PORT_BASE = 8900
ROUTING_POLICIES = ("affinity", "least-loaded", "kv-aware")
LOG_FORMATS = ("text", "json")
ROLES = ("single", "pe", "ce")
API_KEY_ENV = "PDSERVE_API_KEY"
PREFILL_ENVELOPE_BYTES = 64 * 1024  # a /prefill body's fields beside the prompt and the client's text
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # the parsers pd/chat/reasoning.py implements (tested to agree)
PE_LOAD_WEIGHT = 0.25  # --kv-load-weight's default on a CE (pd/disagg/kv_choice.py)
PE_ROUTING = ("affinity", "least-loaded", "round-robin", "kv-aware")
DNS_SCHEME = "dns+"


# ---- the settings every pdserve HTTP process has (the server, `pdserve router`), declared once -----------


def host_setting() -> Any:
    return field(default="127.0.0.1", metadata={"help": "address the HTTP server binds"})


def max_body_bytes_setting(more: str = "") -> Any:
    return field(default=4 * 1024 * 1024, metadata={"help": "larger request bodies get 413" + more})


def log_level_setting() -> Any:
    return field(default="info", metadata={"help": "debug | info | warning | error"})


def log_format_setting() -> Any:
    return field(
        default="text",
        metadata={
            "help": "text, or json: one JSON object per line (time, level, logger, message, request_id)",
            "choices": LOG_FORMATS,
        },
    )


def access_log_setting() -> Any:
    return field(
        default=False, metadata={"help": "log one line per HTTP request (address, request, status, time, id)"}
    )


def body_timeout_setting() -> Any:
    return field(
        default=30.0,
        metadata={"flag": "body-timeout", "help": "a request body must arrive within this, else 408"},
    )


def shutdown_timeout_setting(process: str, meanwhile: str) -> Any:
    return field(
        default=30.0,
        metadata={
            "flag": "shutdown-timeout",
            "help": f"on SIGTERM, requests in flight get this long to finish ({meanwhile}), then the "
            f"{process} stops",
        },
    )


def check_http_settings(
    port: int | None, max_body_bytes: int, log_format: str, body_timeout_s: float, shutdown_timeout_s: float
) -> None:
    """The checks of the settings above (and --port's range); ValueError names the flag."""
    if port is not None and not 0 <= port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {max_body_bytes}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {log_format!r}")
    if body_timeout_s <= 0:
        raise ValueError(f"--body-timeout must be > 0, got {body_timeout_s}")
    if shutdown_timeout_s < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout_s}")


TP_TRANSPORTS = names_where(lambda c: c.tp_layouts)  # what a --tp group hands off over (at either end)


@dataclass(frozen=True)
class Target:
    """One entry of --prefill-url: a fixed URL, or (dns) a name whose addresses are the PEs."""

    url: str  # as written, minus a trailing slash
    dns: bool = False

    @property
    def scheme(self) -> str:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).scheme

    @property
    def host(self) -> str:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url.removeprefix(DNS_SCHEME)).port or (443 if self.scheme == "https" else 80)


def parse_prefill_urls(value: str) -> list[Target]:
    """The targets of a --prefill-url value (comma-separated); ValueError names the bad entry."""
    return parse_targets(value, "--prefill-url")


def parse_targets(value: str, flag: str) -> list[Target]:
    """The targets of a list-of-servers flag (--prefill-url, the router's --decode-url): comma-separated
    http(s)://HOST:PORT and dns+http(s)://NAME:PORT entries; ValueError names the flag and the bad entry."""
    targets: list[Target] = []
    for raw in value.split(","):
        entry = raw.strip().rstrip("/")
        if not entry:
            raise ValueError(f"{flag} has an empty entry: {value!r}")
        dns = entry.startswith(DNS_SCHEME)
        parts = urlsplit(entry.removeprefix(DNS_SCHEME))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{flag} entry {entry!r} is not http(s)://HOST:PORT or dns+http(s)://NAME:PORT"
            )
        try:
            parts.port  # noqa: B018 (a port out of range raises here)
        except ValueError as e:
            raise ValueError(f"{flag} entry {entry!r}: {e}") from None
        if parts.path or parts.query or parts.fragment:
            raise ValueError(f"{flag} entry {entry!r} must not have a path")
        if dns and parts.port is None:
            raise ValueError(f"{flag} entry {entry!r} needs a port")
        t = Target(entry, dns)
        if t in targets:
            raise ValueError(f"{flag} names {entry!r} twice")
        targets.append(t)
    return targets



@dataclass(frozen=True)
class RoleConfig:
    """What a P/D rank process is told about its role (pd/rank/prefill_role.py, pd/rank/decode_role.py)."""

    token_file: str | None = field(
        metadata={"help": "the cluster token's file; None: $PDSERVE_CLUSTER_TOKEN(_FILE)"}
    )
    kv_host: str = field(metadata={"help": "decode: the address its KV receiver binds (a prefill rank ignores it)"})
    kv_port: int = field(metadata={"help": "decode: the port its KV receiver binds (a prefill rank ignores it)"})
    transfer: TransferConfig = field(metadata={"help": "how it sends or receives handoffs"})

    def __post_init__(self) -> None:
        if not 0 <= self.kv_port < 65536:  # 0: any free port (tests)
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the engine ranks it starts."""

    role: str = field(
        default="single",
        metadata={
            "help": "single (prefill and decode colocated) | pe (prefill engine: POST /prefill) | "
            "ce (decode engine: the OpenAI API and the KV receivers)",
            "choices": ROLES,
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "the model name clients use; default: --model"}
    )
    host: str = host_setting()
    port: int | None = field(
        default=None,
        metadata={"help": f"HTTP port; default {DEFAULT_PORT} ({DEFAULT_PE_PORT} for --role pe)"},
    )
    dp: int = field(
        default=1,
        metadata={
            "help": "engine ranks (one process each; one GPU each on CUDA)",
            "aliases": ("data-parallel-size", "-dp"),  # vLLM's names
        },
    )
    ep: int = field(
        default=1,
        metadata={
            "help": "expert parallelism for MoE models: --ep N with --dp N splits every MoE layer's experts "
            "over the N ranks (attention stays data-parallel); the ranks step together and restart together. "
            "With --tp: --ep = --dp x --tp, the experts split over every process of every rank"
        },
    )
    tp: int = field(
        default=1,
        metadata={
            "help": "tensor parallelism (dense and MoE models with per-head attention): each engine rank is a group of N processes (one GPU "
            "each on CUDA) holding one model split Megatron-style; the group's first process schedules "
            "and samples, the others follow its steps; with --role pe|ce a handoff carries every KV head and "
            "each group's first process re-shards them, so any --tp hands off to any --tp "
            f"(over {' or '.join(TP_TRANSPORTS)})",
            "aliases": ("tensor-parallel-size", "-tp"),  # vLLM's names
        },
    )
    routing: str = field(
        default="affinity",
        metadata={
            "help": "rank choice: affinity (a conversation stays on one rank) | least-loaded | kv-aware (the "
            "lowest cost: the prompt tokens left after the prefix a rank's caches hold, from its KV events "
            "(needs --kv-events-config), plus the work it has in flight; ties: affinity's order)",
            "choices": ROUTING_POLICIES,
        },
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "a Jinja file that replaces the checkpoint's chat template"}
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "split the model's <think>...</think> from its chat answers into reasoning_content: "
            "deepseek_r1 (the answer starts in thinking) | qwen3 (thinking when the answer starts with "
            "<think>); default: no split",
            "choices": REASONING_PARSERS,
        },
    )
    max_body_bytes: int = max_body_bytes_setting(
        "; a prefill engine's /prefill takes what a decode engine with the same flags may forward (twice "
        "this, plus the prompt as token ids)"
    )
    rank_start_timeout_s: float = field(
        default=600.0, metadata={"help": "engine ranks must be up within this"}
    )
    rank_restart_max: int = field(
        default=5,
        metadata={
            "help": "a dead engine rank is restarted at most this often per --rank-restart-window-s, "
            "then stays down; 0: never"
        },
    )
    rank_restart_window_s: float = field(
        default=600.0, metadata={"help": "the sliding window (seconds) --rank-restart-max counts in"}
    )
    rank_restart_backoff_s: float = field(
        default=1.0,
        metadata={
            "help": "wait before a dead rank's restart; doubles per restart in the window, "
            "up to --rank-restart-max-backoff-s"
        },
    )
    rank_restart_max_backoff_s: float = field(
        default=30.0, metadata={"help": "the longest wait before a rank's restart"}
    )
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()
    access_log: bool = access_log_setting()
    # ---- vLLM's switches of what this server always does: taken so vLLM's command lines start it ----
    enable_tokenizer_info_endpoint: bool = field(
        default=True, metadata={"help": "vLLM's: GET /tokenizer_info is always served here (--no-... is refused)"}
    )
    enable_server_load_tracking: bool = field(
        default=True,
        metadata={"help": "vLLM's: GET /load (requests in flight) is always served here (--no-... is refused)"},
    )
    enable_prompt_tokens_details: bool = field(
        default=True,
        metadata={
            "help": "vLLM's: usage.prompt_tokens_details.cached_tokens is always in answers here, as in "
            "OpenAI's API (--no-... is refused)"
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "vLLM's: the sampling defaults of a request that does not set them: auto (the "
            "checkpoint's generation_config.json: its temperature, top_p, top_k, min_p, "
            "repetition_penalty) | vllm (none: temperature 1, no top-p/top-k/min-p, no penalty) | a folder "
            "holding a generation_config.json"
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "vLLM's: taken, and changes nothing: pdserve never runs code from a checkpoint (its model "
            "families are its own, engine/models/); a checkpoint of another architecture is refused by name"
        },
    )
    kv_transfer_config: str | None = field(
        default=None,
        metadata={
            "help": "vLLM's P/D JSON, mapped onto these flags: kv_role kv_producer = --role pe, kv_consumer "
            "= --role ce, kv_both = the --role given; kv_connector NixlConnector = --transport nixl, "
            "P2pNcclConnector = nccl (the transport a prefill engine sends with; a decode engine takes "
            "--accept-transports); kv_ip / kv_port = --kv-host / --kv-port-base (decode). Other "
            "connectors and keys are refused, named"
        },
    )
    # ---- HTTP limits and security (every role) ----
    api_key: str | None = field(
        default=None,
        metadata={"help": "clients must send `Authorization: Bearer KEY` on /v1/*; default $PDSERVE_API_KEY"},
    )
    ssl_certfile: str | None = field(
        default=None, metadata={"help": "serve HTTPS with this certificate (PEM)"}
    )
    ssl_keyfile: str | None = field(default=None, metadata={"help": "the certificate's private key (PEM)"})
    ssl_ca_certs: str | None = field(
        default=None,
        metadata={"help": "decode: CA certificates that verify an https --prefill-url; default the system's"},
    )
    http_max_connections: int = field(
        default=1024, metadata={"help": "HTTP connections held at once; more get 503 and are closed"}
    )
    timeout_keep_alive_s: float = field(
        default=5.0,
        metadata={
            "flag": "timeout-keep-alive",
            "help": "an HTTP connection without a complete request for this long (idle, or headers "
            "still arriving) is closed",
        },
    )
    body_timeout_s: float = body_timeout_setting()
    shutdown_timeout_s: float = shutdown_timeout_setting("server", "new ones get 503")
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "engine (every rank)"})
    # ---- P/D (--role pe|ce) ----
    prefill_url: str = field(
        default=f"http://127.0.0.1:{DEFAULT_PE_PORT}",
        metadata={
            "help": "decode: the prefill engines' servers, comma-separated; dns+http://NAME:PORT stands "
            "for every address NAME resolves to (a Kubernetes headless service), looked up again every "
            "--pe-dns-refresh-s. Give every decode engine the same list"
        },
    )
    pe_routing: str = field(
        default="affinity",
        metadata={
            "help": "decode: prefill engine choice: affinity (rendezvous hashing of the conversation: "
            "its turns meet their prefix cache, from any decode engine) | least-loaded | round-robin | "
            "kv-aware (the lowest cost: the prompt tokens left after the prefix a PE holds, from its ranks' "
            "KV events (start the PEs with --kv-events-config), plus --kv-load-weight times the work it "
            "has in flight)",
            "choices": PE_ROUTING,
        },
    )
    kv_load_weight: float = field(
        default=PE_LOAD_WEIGHT,
        metadata={
            "help": "decode, kv-aware: what a token of work a PE has in flight weighs against one this "
            "prompt would compute there (1: the least time to the first token if PEs ran apart; lower: "
            "more prefix reuse, hot prefixes copied later; 0.25 measured best on Mooncake's traces, "
            "bench/figures/kv-routing-cpu.md)"
        },
    )
    pe_load_slack: float = field(
        default=0.5,
        metadata={
            "help": "decode, affinity: a prefill engine holding (1 + this) times the mean in-flight "
            "prefills is passed over for the next in the conversation's order"
        },
    )
    pe_dns_refresh_s: float = field(
        default=10.0, metadata={"help": "decode: how often dns+ entries of --prefill-url are resolved again"}
    )
    kv_host: str = field(default="127.0.0.1", metadata={"help": "decode: address the KV receivers bind"})
    kv_advertise_host: str | None = field(
        default=None, metadata={"help": "decode: address the prefill engine sends KV to; default --kv-host"}
    )
    kv_port_base: int = field(
        default=DEFAULT_KV_PORT_BASE, metadata={"help": "decode: rank i receives KV on kv_port_base + i"}
    )
    handoff_lease_s: float = field(
        default=30.0,
        metadata={"help": "prefill: a prefilled sequence's KV is kept at most this long for the decode engine's ack"},
    )
    prefill_timeout_s: float = field(
        default=600.0, metadata={"help": "decode: a /prefill answer (the prefill engine's queue, prefill and handoff) within this"}
    )
    fallback_local_prefill: bool = field(
        default=False, metadata={"help": "decode: prefill locally when the prefill engine fails or is unreachable"}
    )
    local_prefill_max_tokens: int = field(
        default=0,
        metadata={
            "help": "decode: a request with at most this many prompt tokens left after the prefix this "
            "CE's decode cache holds (a conversation's next turn) is prefilled here, without a prefill "
            "engine or a handoff; 0: never"
        },
    )
    max_queued_requests: int = field(
        default=256, metadata={"help": "decode: requests waiting for decode memory; more get 429"}
    )
    queue_timeout_s: float = field(
        default=120.0, metadata={"help": "decode: a request waits this long for decode memory, then 503"}
    )
    prefill_auth_window_s: float = field(
        default=60.0,
        metadata={
            "help": "prefill: a signed /prefill must be this fresh (seconds, either way); its nonce is "
            "remembered this long, so a replay is refused"
        },
    )
    cluster_token_file: str | None = field(
        default=None, metadata={"help": "the cluster token's file; default $PDSERVE_CLUSTER_TOKEN(_FILE)"}
    )
    transfer: TransferConfig = field(
        default_factory=TransferConfig, metadata={"help": "how KV is handed off (--role pe|ce)"}
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}, got {self.role!r}")
        for name in ("enable_tokenizer_info_endpoint", "enable_server_load_tracking", "enable_prompt_tokens_details"):
            if not getattr(self, name):
                flag = name.replace("_", "-")
                raise ValueError(f"--no-{flag}: this server always does what vLLM's --{flag} turns on")
        if not (0 < self.kv_port_base and self.kv_port_base + self.dp <= 65536):
            raise ValueError(f"--kv-port-base must leave a port per rank, got {self.kv_port_base}")
        if min(self.handoff_lease_s, self.prefill_timeout_s, self.queue_timeout_s) <= 0:
            raise ValueError("--handoff-lease-s, --prefill-timeout-s and --queue-timeout-s must be > 0")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        # the group's first process re-shards a handoff (engine/handoff/kv_shards.py): the transports with
        # Capabilities.tp_layouts carry it (tcp and nixl, tested on the CPU); ipc and nccl have not run
        # with a group of GPUs yet
        if self.tp > 1 and self.role == "pe" and self.transfer.transport not in TP_TRANSPORTS:
            raise ValueError(
                f"--tp {self.tp} with --role pe hands off over --transport {' or '.join(TP_TRANSPORTS)} only so far,"
                f" got --transport {self.transfer.transport}"
            )
        if self.tp > 1 and self.role == "ce" and not set(self.transfer.accept_transports) <= set(TP_TRANSPORTS):
            raise ValueError(
                f"--tp {self.tp} with --role ce takes handoffs over {' and '.join(TP_TRANSPORTS)} only so far: pass"
                f" --accept-transports {','.join(TP_TRANSPORTS)} (got {','.join(self.transfer.accept_transports)})"
            )
        if self.ep not in (1, self.dp * self.tp):
            world = "--dp" if self.tp == 1 else f"--dp x --tp = {self.dp * self.tp}"
            raise ValueError(
                f"--ep must be 1 or equal to {world} (one expert-parallel group of every engine process), got {self.ep}"
            )
        check_http_settings(
            self.port, self.max_body_bytes, self.log_format, self.body_timeout_s, self.shutdown_timeout_s
        )
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        events = self.engine.kv_events()
        if self.routing == "kv-aware" and (events is None or not events.publishes):
            raise ValueError(
                "--routing kv-aware chooses by the ranks' KV events, and they publish none: add --kv-events-config "
                "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:PORT\"}' (publisher zmq)"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.rank_restart_max < 0 or self.rank_restart_window_s <= 0:
            raise ValueError("--rank-restart-max must be >= 0 and --rank-restart-window-s > 0")
        if not 0 <= self.rank_restart_backoff_s <= self.rank_restart_max_backoff_s:
            raise ValueError("need 0 <= --rank-restart-backoff-s <= --rank-restart-max-backoff-s")
        if min(self.timeout_keep_alive_s, self.prefill_auth_window_s) <= 0:
            raise ValueError("--timeout-keep-alive and --prefill-auth-window-s must be > 0")
        if self.http_max_connections < 1:
            raise ValueError(f"--http-max-connections must be >= 1, got {self.http_max_connections}")
        if bool(self.ssl_keyfile) and not self.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.pe_routing not in PE_ROUTING:
            raise ValueError(f"--pe-routing must be one of {PE_ROUTING}, got {self.pe_routing!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.kv_load_weight < 0:
            raise ValueError(f"--kv-load-weight must be >= 0, got {self.kv_load_weight}")
        if self.pe_load_slack < 0 or self.pe_dns_refresh_s <= 0:
            raise ValueError("--pe-load-slack must be >= 0 and --pe-dns-refresh-s > 0")
        parse_prefill_urls(self.prefill_url)  # raises ValueError naming a bad entry
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(self.generation_config, "generation_config.json")
        ):
            raise ValueError(
                f"--generation-config takes auto, vllm or a folder holding a generation_config.json; "
                f"{self.generation_config!r} has none"
            )

    @property
    def http_port(self) -> int:
        """The port the HTTP server listens on (--port, else the role's default)."""
        if self.port is not None:
            return self.port
        return DEFAULT_PE_PORT if self.role == "pe" else DEFAULT_PORT

    @property
    def prefill_max_body_bytes(self) -> int:
        """The largest /prefill body: what a decode engine with these --max-body-bytes and
        --max-model-len can make of a request it accepted, so the two sides' limits agree. The client's
        text is re-encoded (a structured-output spec sent as a JSON object becomes a JSON string: every
        quote and backslash escaped, at most twice its bytes), the prompt travels as token ids
        (at most 11 bytes each), and the envelope is small. A decode engine refuses with 413 what would
        still be larger (pd/disagg/decode_path.py); a prefill engine takes up to this on /prefill."""
        max_len = self.engine.max_model_len or MAX_DEFAULT_MODEL_LEN
        return 2 * self.max_body_bytes + 11 * max_len + PREFILL_ENVELOPE_BYTES

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def is_pd(self) -> bool:
        return self.role != "single"

    def kv_address(self, rank: int) -> str:
        """Where the PE sends rank's handoffs ("host:port")."""
        host = self.kv_advertise_host or self.kv_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return f"[{host}]:{self.kv_port_base + rank}" if ":" in host else f"{host}:{self.kv_port_base + rank}"

    def role_config(self, rank: int) -> RoleConfig:
        """What P/D rank `rank` is told about its role."""
        return RoleConfig(self.cluster_token_file, self.kv_host, self.kv_port_base + rank, self.transfer)

    @classmethod
    def parser(
        cls, prog: str = "python -m pd.server", is_model_positional: bool = False
    ) -> argparse.ArgumentParser:
        """The server's flags and --config; is_model_positional: `MODEL` may stand for --model MODEL
        (`pdserve serve MODEL`)."""
        parser = parser_for(cls, prog, "pdserve OpenAI-compatible server")
        add_config_flag(parser)
        if is_model_positional:
            parser.add_argument(
                "model_tag", nargs="?", metavar="MODEL", help="the model, as --model (wins over it)"
            )
        return parser

    @classmethod
    def from_argv(
        cls,
        argv: list[str] | None = None,
        prog: str = "python -m pd.server",
        is_model_positional: bool = False,
    ) -> ServerConfig:
        """The config the command line (and its --config file) gives (argparse exits on an unknown or
        misspelled flag or config key; a bad value raises ValueError)."""
        ns = parse_args(cls.parser(prog, is_model_positional), cls, argv)
        if getattr(ns, "model_tag", None) is not None:
            setattr(ns, "engine.model", ns.model_tag)
        if ns.kv_transfer_config is not None:
            _apply_kv_transfer_config(ns)
        cfg = from_flags(cls, ns)
        if cfg.api_key is None and os.environ.get(API_KEY_ENV):
            cfg = dataclasses.replace(cfg, api_key=os.environ[API_KEY_ENV])
        return cfg


def _apply_kv_transfer_config(ns: argparse.Namespace) -> None:
    """Sets the flags --kv-transfer-config stands for (pd/kv_transfer_config.py) in the parsed ns; one also
    given (not at its default) with another value is a ValueError naming both."""
    values = vars(ns)
    by_dest = {f.dest: f for f in flags(ServerConfig)}
    for dest, value in kv_transfer_settings(ns.kv_transfer_config, ns.role).items():
        f = by_dest[dest]
        if values[dest] not in (f.default, value):
            raise ValueError(
                f"--kv-transfer-config says {f.names[0]} {value}, but {f.names[0]} {values[dest]} is given"
            )
        setattr(ns, dest, value)
