"""The Grafana dashboard (deploy/grafana/pdserve.json): its structure, and every metric its queries name
against the /metrics of real servers (a single-engine server and a P/D pair, SmolLM2-135M) after a chat
request, so a misspelled or renamed metric fails here rather than as an empty panel.

Queries name series as Prometheus stores them (`X_total` for a counter, `X_bucket` / `X_sum` / `X_count`
for a histogram), which is how /metrics writes them: names are compared to the exposition's sample names
as they are, suffix included."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
MODEL = "smollm2-135m-instruct"
MODEL_FILTER = 'model_name=~"$model_name"'

# PromQL's functions and aggregation operators: an identifier followed by "(" must be one of them
PROMQL_FUNCTIONS = frozenset(
    """abs absent absent_over_time avg avg_over_time bottomk ceil changes clamp clamp_max clamp_min count
    count_over_time count_values delta deriv exp floor group histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum idelta increase irate label_join
    label_replace last_over_time ln log10 log2 max max_over_time min min_over_time predict_linear
    present_over_time quantile quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev
    stddev_over_time stdvar stdvar_over_time sum sum_over_time time timestamp topk vector""".split()
)
PROMQL_KEYWORDS = frozenset("and or unless bool offset group_left group_right inf nan".split())

_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# an identifier not inside a number or a duration ("5m", "1e3")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?")
_LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ", re.M)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects; raises ValueError on a call of an unknown function."""
    rest = _VARIABLE.sub("", expr)
    for pattern in (_STRING, _MATCHERS, _RANGE, _GROUPING):
        rest = pattern.sub(" ", rest)
    names = set()
    for m in _IDENT.finditer(rest):
        word, is_call = m.group(1), m.group(2) is not None
        if is_call:
            if word not in PROMQL_FUNCTIONS:
                raise ValueError(f"{word}(...) is no PromQL function in {expr!r}")
        elif word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def exposition_labels(text: str) -> dict[str, set[str]]:
    """The sample names of a /metrics text -> the label names their samples carry."""
    out: dict[str, set[str]] = {}
    for m in _SAMPLE.finditer(text):
        labels = re.findall(r'(\w+)="', m.group(2) or "")
        out.setdefault(m.group(1), set()).update(labels)
    return out


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query in every panel, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            found += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return found


def variable_queries(dashboard: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Query variables: name -> (metric, label) of their label_values(metric, label)."""
    out = {}
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = _LABEL_VALUES.match(query)
            assert m, f"variable {v['name']}: {query!r} is not label_values(metric, label)"
            out[v["name"]] = (m.group(1), m.group(2))
    return out


def missing_metrics(dashboard: dict[str, Any], exported: dict[str, set[str]]) -> list[str]:
    """What the dashboard asks of the servers that no server exports: series, their labels, filters."""
    problems = []
    for title, expr in targets(dashboard):
        for name in sorted(metric_names(expr)):
            if name not in exported:
                problems.append(f"{title!r}: no server exports {name}")
            elif "model_name" in exported[name] and MODEL_FILTER not in expr:
                problems.append(f"{title!r}: {name} is not filtered by {MODEL_FILTER}")
    for var, (name, label) in variable_queries(dashboard).items():
        if label not in exported.get(name, set()):
            problems.append(f"variable {var}: no server exports {name} with the label {label}")
    return problems


# ---- the dashboard's shape ----------------------------------------------------------------------------


def test_dashboard_structure():
    d = load_dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["model_name"]["datasource"]["uid"] == "${datasource}"
    assert variables["model_name"]["includeAll"] and variables["model_name"]["allValue"] == ".*"
    panels = [q for p in d["panels"] for q in [p, *p.get("panels", [])]]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for p in panels:
        assert p.get("title"), f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
            assert metric_names(t["expr"]), f"{p['title']!r}: {t['expr']!r} selects no metric"


def test_metric_names_of_promql():
    expr = (
        'histogram_quantile(0.99, sum by (le, phase) (rate(a_bucket{model_name=~"$model_name", x="b c"}'
        "[$__rate_interval] offset 5m))) / on (instance) group_left b_total * 1e3 > bool 0"
        " or increase(c:d[1h]) unless sum without (rank) (e)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c:d", "e"}
    with pytest.raises(ValueError, match="histogram_quantil"):
        metric_names("histogram_quantil(0.5, x_bucket)")


def test_check_fails_on_a_misspelled_metric():
    exported = exposition_labels(
        '# HELP x_total X\nx_total{model_name="m",rank="0"} 1.0\ny_bucket{le="1.0"} 2.0\nz 0.0\n'
    )
    assert exported == {"x_total": {"model_name", "rank"}, "y_bucket": {"le"}, "z": set()}
    dashboard: dict[str, Any] = {
        "panels": [{"title": "p", "targets": [{"expr": f"rate(x_total{{{MODEL_FILTER}}}[5m]) + y_bucket"}]}],
        "templating": {
            "list": [{"type": "query", "name": "v", "query": "label_values(x_total, model_name)"}]
        },
    }
    assert missing_metrics(dashboard, exported) == []
    dashboard["panels"][0]["targets"][0]["expr"] = "rate(x_totl[5m]) + rate(x_total[5m]) + z"
    assert missing_metrics(dashboard, exported) == [
        f"'p': x_total is not filtered by {MODEL_FILTER}",
        "'p': no server exports x_totl",
    ]
    dashboard["templating"]["list"][0]["query"] = "label_values(z, model_name)"
    assert (
        missing_metrics(dashboard, exported)[-1]
        == "variable v: no server exports z with the label model_name"
    )


# The check against real servers (a single engine, a PE and a CE) is in tests/pd/disagg/test_pair_e2e.py
# (test_every_dashboard_metric_is_exported), which has those servers running already.
