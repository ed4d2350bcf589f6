"""RouterConfig: every setting of `pdserve router`, with its default and help (flags derive from it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pd.config import (
    access_log_setting,
    body_timeout_setting,
    check_http_settings,
    host_setting,
    log_format_setting,
    log_level_setting,
    max_body_bytes_setting,
    parse_targets,
    shutdown_timeout_setting,
)
from pd.flags import add_config_flag, from_flags, parse_args, parser_for

ROUTER_ROUTING = ("affinity", "kv-aware")


@dataclass(frozen=True)
class RouterConfig:
    decode_url: str = field(
        default="",
        metadata={
            "help": "the CEs: comma-separated http(s)://HOST:PORT, and dns+http://NAME:PORT for every "
            "address NAME resolves to (looked up again every --dns-refresh-s); every router replica "
            "must be given the same list"
        },
    )
    host: str = host_setting()
    port: int = field(default=8080, metadata={"help": "port the router listens on"})
    load_slack: float = field(
        default=0.5,
        metadata={
            "help": "a conversation's CE holding ceil((1 + slack) * (in flight + 1) / CEs up) requests "
            "is passed over for the next in its rendezvous order"
        },
    )
    load_floor: int = field(
        default=8,
        metadata={
            "help": "a CE is passed over for load only when it holds at least this many requests (at low "
            "load, a conversation stays on its CE)"
        },
    )
    routing: str = field(
        default="affinity",
        metadata={
            "help": "how a request's CE is chosen: affinity (rendezvous hashing of the conversation key, "
            "bounded by --load-slack/--load-floor) or kv-aware (the CE with the least left to do: its "
            "cached prefix of the prompt from its KV events (--kv-events-config on the CEs) plus the work "
            "it has in flight; a chat's token ids come from a CE's /tokenize)",
            "choices": ROUTER_ROUTING,
        },
    )
    kv_load_weight: float = field(
        default=1.0,
        metadata={
            "help": "kv-aware: what a token of work a CE has in flight weighs against one this prompt "
            "would cost there (pd/disagg/kv_choice.py; 1: a CE's held prefix saves a handoff, not a "
            "prefill, and its decode load is what the choice must spread)"
        },
    )
    health_interval_s: float = field(
        default=2.0, metadata={"help": "seconds between /health/ready probes of a CE that is up"}
    )
    dns_refresh_s: float = field(default=10.0, metadata={"help": "seconds between lookups of dns+ entries"})
    connect_timeout_s: float = field(
        default=5.0, metadata={"help": "a CE that does not accept the connection within this is failed over"}
    )
    max_body_bytes: int = max_body_bytes_setting()
    body_timeout_s: float = body_timeout_setting()
    shutdown_timeout_s: float = shutdown_timeout_setting("router", "new connections are refused")
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()
    access_log: bool = access_log_setting()

    def __post_init__(self) -> None:
        if not self.decode_url:
            raise ValueError("--decode-url is required: the CEs to route to")
        parse_targets(self.decode_url, "--decode-url")  # raises ValueError naming a bad entry
        check_http_settings(
            self.port, self.max_body_bytes, self.log_format, self.body_timeout_s, self.shutdown_timeout_s
        )
        if self.load_slack < 0 or self.load_floor < 0:
            raise ValueError(
                f"--load-slack and --load-floor must be >= 0, got {self.load_slack}, {self.load_floor}"
            )
        if self.kv_load_weight < 0:
            raise ValueError(f"--kv-load-weight must be >= 0, got {self.kv_load_weight}")
        if self.routing not in ROUTER_ROUTING:
            raise ValueError(f"--routing must be one of {ROUTER_ROUTING}, got {self.routing!r}")
        if min(self.health_interval_s, self.dns_refresh_s, self.connect_timeout_s) <= 0:
            raise ValueError("--health-interval-s, --dns-refresh-s and --connect-timeout-s must be > 0")

    @classmethod
    def parser(cls, prog: str = "pdserve router") -> argparse.ArgumentParser:
        """The router's flags and --config."""
        parser = parser_for(cls, prog, "An HTTP front over the CEs: conversation affinity, failover.")
        add_config_flag(parser)
        return parser

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, prog: str = "pdserve router") -> RouterConfig:
        """The config the command line (and its --config file) gives; a bad value raises ValueError."""
        return from_flags(cls, parse_args(cls.parser(prog), cls, argv))
