"""deploy/k8s/monitoring/ (a ServiceMonitor and KEDA ScaledObjects: custom resources, which the bundled
Kubernetes schemas do not cover), checked against the base, the servers and the router: the
ServiceMonitor selects the PE, CE and router Services by their labels (each pod once) and scrapes a port
they name and a route the servers and the router serve; each
ScaledObject scales a workload of the base, on a PromQL query over series the servers export (their names
are checked against live servers in tests/pd/disagg/test_pair_e2e.py, with the dashboard's) and the
`service` label the ServiceMonitor gives them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pd.config import ServerConfig
from pd.frontend.coordinator import Coordinator
from pd.router.config import RouterConfig
from pd.router.server import Router
from pd.router.server import make_app as make_router_app
from pd.server import make_app, make_prefill_app
from tests.deploy.kustomize import K8S_DIR, MONITORING_DIR, kustomize_build, listed_and_on_disk, resources
from tests.deploy.test_grafana_dashboard import metric_names

_SERVICE_MATCHER = re.compile(r'\bservice="([^"]+)"')


BASE = [doc for _, doc in resources(K8S_DIR)]
MONITORING = [doc for _, doc in resources(MONITORING_DIR)]


def _base(kind: str) -> list[dict[str, Any]]:
    return [d for d in BASE if d["kind"] == kind]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions, as Kubernetes evaluates them) against labels;
    an empty one is refused here (it would select every Service of the namespace)."""
    assert selector.get("matchLabels") or selector.get("matchExpressions"), selector
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pods_of(service: dict[str, Any]) -> str:
    """The workload whose pods the Service selects (the base has one per Service)."""
    (workload,) = [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in BASE
        if d["kind"] in ("Deployment", "StatefulSet") and _selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    return workload


def scaling_queries() -> list[str]:
    """The PromQL query of every ScaledObject trigger in deploy/k8s/monitoring/."""
    return [
        t["metadata"]["query"]
        for d in MONITORING
        if d["kind"] == "ScaledObject"
        for t in d["spec"]["triggers"]
        if t["type"] == "prometheus"
    ]


def test_every_file_is_listed_and_only_custom_resources_are_here() -> None:
    listed, on_disk = listed_and_on_disk(MONITORING_DIR)
    assert listed == on_disk
    assert {(d["apiVersion"], d["kind"]) for d in MONITORING} == {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("keda.sh/v1alpha1", "ScaledObject"),
    }


def test_the_service_monitor_scrapes_every_server_and_the_router_once() -> None:
    (monitor,) = [d for d in MONITORING if d["kind"] == "ServiceMonitor"]
    selector = monitor["spec"]["selector"]
    selected = [s for s in _base("Service") if _matches(selector, s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in selected} == {"pdserve-pe", "pdserve-ce", "pdserve-router"}
    # the ScaledObjects sum a workload's series by `service`: a second Service over its pods doubles them
    workloads = [_pods_of(s) for s in selected]
    assert len(set(workloads)) == len(workloads), f"pods scraped through two Services: {workloads}"
    for endpoint in monitor["spec"]["endpoints"]:
        for service in selected:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]
        for role in ("pe", "ce"):
            co = Coordinator(ServerConfig(role=role))
            app = make_prefill_app(co, b"0" * 32) if role == "pe" else make_app(co)
            routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}
            assert endpoint["path"] in routes, (role, endpoint["path"])
        # the router's own GET routes (any other path it passes to a CE)
        app = make_router_app(Router(RouterConfig(decode_url="http://127.0.0.1:8888")))
        routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}
        assert endpoint["path"] in routes, ("router", endpoint["path"])


@pytest.mark.parametrize("scaled", [d for d in MONITORING if d["kind"] == "ScaledObject"], ids=lambda d: d["metadata"]["name"])
def test_a_scaled_object_scales_a_workload_on_its_own_queue(scaled: dict[str, Any]) -> None:
    target = scaled["spec"]["scaleTargetRef"]
    workloads = [d for d in BASE if d["kind"] == target.get("kind", "Deployment") and d["metadata"]["name"] == target["name"]]
    assert len(workloads) == 1, f"no {target} in the base"
    pod_labels = workloads[0]["spec"]["template"]["metadata"]["labels"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert meta["serverAddress"].startswith("http") and float(meta["threshold"]) > 0
        assert metric_names(meta["query"]), meta["query"]  # PromQL that names a series
        # the series of this workload's pods: the ServiceMonitor labels them with their Service
        (service_name,) = _SERVICE_MATCHER.findall(meta["query"])
        (service,) = [s for s in _base("Service") if s["metadata"]["name"] == service_name]
        assert _selects(service["spec"]["selector"], pod_labels), (service_name, target)


def test_kustomize_builds_the_monitoring_folder() -> None:
    _, docs = kustomize_build(MONITORING_DIR)
    assert len(docs) == len(MONITORING)
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve" for d in docs)
