"""RouterConfig: every setting of `pdserve router`, with its default and help (flags derive from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd.config import LOG_FORMATS, parse_targets
from pd.flags import add_config_flag, from_flags, parse_args, parser_for


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
    host: str = field(default="127.0.0.1", metadata={"help": "address the router listens on"})
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
    health_interval_s: float = field(
        default=2.0, metadata={"help": "seconds between /health/ready probes of a CE that is up"}
    )
    dns_refresh_s: float = field(default=10.0, metadata={"help": "seconds between lookups of dns+ entries"})
    connect_timeout_s: float = field(
        default=5.0, metadata={"help": "a CE that does not accept the connection within this is failed over"}
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata={"help": "largest request body; larger ones get 413"}
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata={"flag": "body-timeout", "help": "a request body must arrive within this, else 408"},
    )
    shutdown_timeout_s: float = field(
        default=30.0,
        metadata={
            "flag": "shutdown-timeout",
            "help": "on SIGTERM, requests in flight get this long to finish, then the router stops",
        },
    )
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    log_format: str = field(
        default="text",
        metadata={"help": "text, or json: one JSON object per line", "choices": LOG_FORMATS},
    )
    access_log: bool = field(
        default=False, metadata={"help": "log one line per HTTP request (address, request, status, time, id)"}
    )

    def __post_init__(self) -> None:
        if not self.decode_url:
            raise ValueError("--decode-url is required: the CEs to route to")
        parse_targets(self.decode_url, "--decode-url")  # raises ValueError naming a bad entry
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.load_slack < 0 or self.load_floor < 0:
            raise ValueError(
                f"--load-slack and --load-floor must be >= 0, got {self.load_slack}, {self.load_floor}"
            )
        if min(self.health_interval_s, self.dns_refresh_s, self.connect_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError(
                "--health-interval-s, --dns-refresh-s, --connect-timeout-s and --body-timeout must be > 0"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {self.log_format!r}")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, prog: str = "pdserve router") -> RouterConfig:
        """The config the command line (and its --config file) gives; a bad value raises ValueError."""
        parser = parser_for(cls, prog, "An HTTP front over the CEs: conversation affinity, failover.")
        add_config_flag(parser)
        return from_flags(cls, parse_args(parser, cls, argv))
