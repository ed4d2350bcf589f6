"""What a run reads from the endpoint's own /metrics, as the difference between a scrape before and one after
the run (so only the run's requests count): a P/D endpoint's TTFT phases (pdserve_ttft_phase_seconds) and,
where the server speculates (--speculative-config), vLLM's speculative-decoding counters
(vllm:spec_decode_num_*_total, summed over ranks and endpoints):

    mean accepted length = 1 + accepted tokens / drafts      (vLLM's: the target's own token counts)
    acceptance rate      = accepted tokens / draft tokens

An endpoint whose /metrics cannot be read counts as one that exports nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# vLLM's names (vllm/v1/spec_decode/metrics.py), as pd/frontend/vllm_metrics.py exports them
SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
_SAMPLE = re.compile(r"^([^\s{]+)(?:\{[^}]*\})? (\S+)$", re.M)


@dataclass(frozen=True)
class Scrape:
    """One reading of the endpoints' /metrics."""

    phases: dict[str, tuple[float, float]]  # TTFT phase -> (sum of seconds, count)
    speculation: dict[str, float] | None  # SPEC_COUNTERS' keys -> total; None: no endpoint speculates


def scrape(chat_url: str) -> Scrape:
    """Reads the /metrics of the endpoint(s) of chat_url (each of a comma-separated list)."""
    import urllib.request

    texts = []
    for url in chat_url.split(","):
        base = url.strip().removesuffix("/chat/completions").removesuffix("/v1")
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                texts.append(r.read().decode())
        except OSError:
            continue
    return Scrape(ttft_phase_totals(texts), speculation_totals(texts))


def ttft_phase_totals(texts: list[str]) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) per TTFT phase over the scraped texts; {} where there are none."""
    out: dict[str, tuple[float, float]] = {}
    for text in texts:
        for line in text.splitlines():
            for i, kind in enumerate(("sum", "count")):
                prefix = f'pdserve_ttft_phase_seconds_{kind}{{phase="'
                if line.startswith(prefix):
                    phase = line[len(prefix) :].split('"', 1)[0]
                    t = list(out.get(phase, (0.0, 0.0)))
                    t[i] += float(line.rsplit(" ", 1)[1])
                    out[phase] = (t[0], t[1])
    return out


def speculation_totals(texts: list[str]) -> dict[str, float] | None:
    """The speculative-decoding counters summed over every rank of every text; None where no text has them
    (a server that does not speculate exports none)."""
    names = {name: key for key, name in SPEC_COUNTERS.items()}
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    seen = False
    for text in texts:
        for m in _SAMPLE.finditer(text):
            key = names.get(m.group(1))
            if key is not None:
                out[key] += float(m.group(2))
                seen = True
    return out if seen else None


def ttft_phases_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float] | None:
    """Mean milliseconds per phase of what was observed between the two scrapes; None if nothing was."""
    means = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            means[phase] = (total - t0) / (count - c0) * 1e3
    return means or None


def speculation(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The run's drafts, draft tokens and accepted tokens, its mean accepted length and acceptance rate
    (None where it drafted nothing); None when the endpoint does not speculate."""
    if after is None:
        return None
    d = {key: after[key] - (before or {}).get(key, 0.0) for key in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "mean_accepted_length": 1 + accepted / drafts if drafts > 0 else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
    }
