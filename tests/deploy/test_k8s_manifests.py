"""The Kubernetes base (deploy/k8s/), checked offline: every resource against the Kubernetes schemas
(kubernetes-validate's bundled ones, strict: an unknown or misspelled field fails), and against the
servers and the router themselves: each container's args parse as `pd.server` (or `pdserve router`)
flags, its probes ask routes the server (or router) serves on the port it listens on, the Services reach
those ports, the CE finds the PEs and the router finds the CEs through headless Services, a pod's grace
period covers the drain, and the init container fills the model cache the server then reads offline.
Containers run the image of deploy/Dockerfile: its entrypoint is read from there."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import yaml

from pd.config import ServerConfig, parse_targets
from pd.frontend.coordinator import Coordinator
from pd.router.config import RouterConfig
from pd.router.server import Router as RouterState
from pd.router.server import make_app as make_router_app
from pd.server import make_app, make_prefill_app
from tests.deploy.kustomize import K8S_DIR, kustomization, kustomize_build, listed_and_on_disk, resources
from transfer.auth import load_token

# the test extra's; a GPU machine's image may lack it (the rest of tests/deploy still runs there)
kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.smoke  # kubernetes-validate and pyyaml at their lower bounds

DOCKERFILE = K8S_DIR.parent / "Dockerfile"
# The oldest Kubernetes the base is meant for (docs/guides/kubernetes.md says so; its preStop is an exec of `sleep`, since
# the `sleep` action is 1.30's), one between, and the newest whose schemas kubernetes-validate bundles.
SCHEMA_VERSIONS = ("1.28", "1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
POD_IP = "10.1.2.3"  # stands for the downward API's status.podIP
# The server stops its ranks after the drain; deploy/*.sh allow 15 s for that (45 s in all).
RANK_STOP_S = 15
# The router has no ranks: after its drain it closes its connections to the CEs.
ROUTER_STOP_S = 5
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def image_entrypoint() -> list[str]:
    """The ENTRYPOINT of deploy/Dockerfile (exec form): what runs a container that sets no command."""
    (line,) = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("ENTRYPOINT ")]
    return list(json.loads(line.removeprefix("ENTRYPOINT ")))


def _kustomization() -> dict[str, Any]:
    return kustomization(K8S_DIR)


RESOURCES = resources(K8S_DIR)


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in RESOURCES if doc["kind"] == kind]


def _generated_config() -> dict[str, dict[str, str]]:
    """ConfigMap name -> data, from the kustomization's configMapGenerator literals."""
    maps: dict[str, dict[str, str]] = {}
    for gen in _kustomization().get("configMapGenerator", []):
        maps[gen["name"]] = dict(literal.split("=", 1) for literal in gen.get("literals", []))
    return maps


T = TypeVar("T")


@dataclass(frozen=True)
class Pdserve:
    """A container that runs pdserve, with what its args say."""

    workload: dict[str, Any]
    container: dict[str, Any]
    argv: list[str]  # its flags, $(VAR) references expanded

    @property
    def name(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}"

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]

    def _parsed(self, parse: Callable[[], T]) -> T:
        """parse()'s config, or the test fails with the parser's complaint."""
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                return parse()
        except SystemExit:  # argparse: an unknown or misspelled flag, or a bad choice
            error = stderr.getvalue().strip().splitlines()[-1:]
        except ValueError as e:  # the config's own check of a value
            error = [str(e)]
        pytest.fail(f"{self.name}: pdserve refuses its flags {self.argv}: {error}")

    def port_number(self, port: int | str) -> int:
        """A probe's or Service's port: a number, or the name of one of the container's ports."""
        if isinstance(port, int):
            return port
        named = {p["name"]: p["containerPort"] for p in self.container.get("ports", []) if "name" in p}
        assert port in named, f"{self.name}: no container port named {port!r}"
        return named[port]


@dataclass(frozen=True)
class Server(Pdserve):
    """A PE or CE container (`pdserve serve`)."""

    is_model_positional: bool  # `pdserve serve [MODEL]` rather than `python -m pd.server`

    def parse(self) -> ServerConfig:
        return self._parsed(lambda: ServerConfig.from_argv(self.argv, is_model_positional=self.is_model_positional))


@dataclass(frozen=True)
class RouterContainer(Pdserve):
    """A router container (`pdserve router`)."""

    def parse(self) -> RouterConfig:
        return self._parsed(lambda: RouterConfig.from_argv(self.argv))


def _env_values(container: dict[str, Any]) -> dict[str, str]:
    """What the container's $(VAR) references expand to (secrets are not expanded: args never need one)."""
    maps = _generated_config()
    values = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", var
            values[var["name"]] = POD_IP
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in maps, f"{var['name']}: no ConfigMap {ref['name']!r} is generated"
            assert ref["key"] in maps[ref["name"]], (
                f"{var['name']}: ConfigMap {ref['name']} lacks {ref['key']!r}"
            )
            values[var["name"]] = maps[ref["name"]][ref["key"]]
    return values


def _expand(arg: str, values: dict[str, str]) -> str:
    return ENV_REF.sub(lambda m: values[m.group(1)], arg)


def command_of(container: dict[str, Any]) -> list[str]:
    """What the container runs: its command (else the image's entrypoint) and args."""
    return list(container.get("command") or image_entrypoint()) + list(container.get("args", []))


def expanded_command(container: dict[str, Any]) -> list[str]:
    """command_of(container) with its $(VAR) references expanded from its env."""
    values = _env_values(container)
    command = command_of(container)
    unknown = {m for arg in command for m in ENV_REF.findall(arg)} - set(values)
    # Kubernetes leaves an undefined $(VAR) as it is: the server would get it literally.
    assert not unknown, f"{container['name']}: args refer to undefined env {sorted(unknown)}"
    return [_expand(arg, values) for arg in command]


SERVER_COMMANDS = (["pdserve", "serve"], ["python", "-m", "pd.server"])
ROUTER_COMMANDS = (["pdserve", "router"], ["python", "-m", "pd.router.server"])


def _containers() -> tuple[list[Server], list[RouterContainer], list[str]]:
    """The base's servers, its routers, and the containers that run neither (by name)."""
    servers, routers, others = [], [], []
    for kind in WORKLOAD_KINDS:
        for workload in _of_kind(kind):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                command = expanded_command(container)
                server = [c for c in SERVER_COMMANDS if command[: len(c)] == c]
                router = [c for c in ROUTER_COMMANDS if command[: len(c)] == c]
                if server:
                    argv = command[len(server[0]) :]
                    servers.append(Server(workload, container, argv, server[0][0] == "pdserve"))
                elif router:
                    routers.append(RouterContainer(workload, container, command[len(router[0]) :]))
                else:
                    others.append(f"{kind}/{workload['metadata']['name']}: {container['name']}")
    return servers, routers, others


SERVERS, ROUTERS, OTHER_CONTAINERS = _containers()


def _by_role() -> dict[str, tuple[Server, ServerConfig]]:
    """role -> the server of that role and its parsed config (the base has one of each)."""
    parsed = [(server, server.parse()) for server in SERVERS]
    roles = {cfg.role: (server, cfg) for server, cfg in parsed}
    assert sorted(roles) == ["ce", "pe"] and len(parsed) == 2, [s.name for s in SERVERS]
    return roles


def _the_router() -> tuple[RouterContainer, RouterConfig]:
    """The router of the base and its parsed config (the base has one router Deployment)."""
    assert len(ROUTERS) == 1, [r.name for r in ROUTERS]
    return ROUTERS[0], ROUTERS[0].parse()


def _http_ports() -> list[tuple[Pdserve, int]]:
    """Every server and router with the port its HTTP API listens on."""
    router, router_cfg = _the_router()
    return [(s, cfg.http_port) for s, cfg in _by_role().values()] + [(router, router_cfg.port)]


def _get_routes(cfg: ServerConfig) -> set[str]:
    """The GET paths the server of this config serves (its app built, nothing started)."""
    co = Coordinator(cfg)
    app = make_prefill_app(co, b"0" * 32) if cfg.role == "pe" else make_app(co)
    return {
        route.resource.canonical for route in app.router.routes() if route.method == "GET" and route.resource
    }


def router_get_routes(cfg: RouterConfig) -> set[str]:
    """The GET paths the router of this config answers itself (its app built, nothing started): not its
    catch-all route (method *), which passes any other path to a CE."""
    app = make_router_app(RouterState(cfg))
    return {
        route.resource.canonical for route in app.router.routes() if route.method == "GET" and route.resource
    }


def _selects(service: dict[str, Any], server: Pdserve) -> bool:
    labels = server.pod["metadata"].get("labels", {})
    selector = service["spec"].get("selector", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- the files ----------------------------------------------------------------------------------


def test_every_manifest_is_listed() -> None:
    listed, on_disk = listed_and_on_disk(K8S_DIR)
    assert listed == on_disk, "kustomization.yaml's resources and deploy/k8s/*.yaml differ"
    assert any(image["name"] == "pdserve" for image in _kustomization()["images"])
    images = {s.container["image"] for s in [*SERVERS, *ROUTERS]}
    assert images == {"pdserve"}, "containers name the image that kustomization.yaml's images: sets"


def _schema_error(doc: dict[str, Any], version: str) -> str | None:
    """Why doc does not match version's strict schema (an unknown field included), or None."""
    try:
        used = kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{doc['kind']}/{doc['metadata']['name']} at {'.'.join(map(str, e.path))}: {e.message}"
    assert used == version, f"validated against {used}, not {version}"
    return None


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize(
    "source,doc", RESOURCES, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in RESOURCES]
)
def test_resource_matches_the_kubernetes_schema(source: str, doc: dict[str, Any], version: str) -> None:
    error = _schema_error(doc, version)
    assert error is None, f"{source}: {error}"


def test_the_schema_check_catches_a_misspelled_field() -> None:
    """The check above can fail: strict schemas refuse an unknown field (here a typo in a probe)."""
    broken = yaml.safe_load(yaml.safe_dump(SERVERS[0].workload))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    error = _schema_error(broken, SCHEMA_VERSIONS[-1])
    assert error is not None and "periodSecond" in error, error


def test_kustomize_builds_the_base() -> None:
    """Where kustomize is at hand: the base renders, the image is set, and the output is valid too."""
    cmd, docs = kustomize_build(K8S_DIR)
    image = next(i for i in _kustomization()["images"] if i["name"] == "pdserve")
    for doc in docs:
        error = _schema_error(doc, SCHEMA_VERSIONS[-1])
        assert error is None, f"{cmd}: {error}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve", doc["metadata"]
        if doc["kind"] in WORKLOAD_KINDS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert c["image"] == f"{image['newName']}:{image['newTag']}"


# ---- the servers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("server", SERVERS, ids=[s.name for s in SERVERS])
def test_args_are_server_flags(server: Server) -> None:
    cfg = server.parse()
    assert cfg.host == "0.0.0.0", f"{server.name}: --host must be reachable from other pods"


def test_one_pe_and_one_ce_serving_one_model() -> None:
    roles = _by_role()
    assert roles["pe"][1].engine.model == roles["ce"][1].engine.model
    assert roles["pe"][0].workload["kind"] == "StatefulSet"
    assert roles["ce"][0].workload["kind"] == "Deployment"


def test_probes_ask_the_servers_routes_on_their_port() -> None:
    for server, cfg in _by_role().values():
        routes = _get_routes(cfg)
        assert {"/health", "/health/live", "/health/ready"} <= routes, routes
        c = server.container
        expected = {"startupProbe": None, "readinessProbe": "/health/ready", "livenessProbe": "/health/live"}
        for kind, path in expected.items():
            probe = c[kind]["httpGet"]
            assert probe["path"] in routes, f"{server.name}: {kind} asks {probe['path']}, not served"
            assert path is None or probe["path"] == path, f"{server.name}: {kind} must ask {path}"
            assert server.port_number(probe["port"]) == cfg.http_port, f"{server.name}: {kind} port"
        startup = c["startupProbe"]
        # Model fetch and load: give it longer than the server's own rank start timeout.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= cfg.rank_start_timeout_s


def test_container_ports_and_gpus_match_the_flags() -> None:
    for server, cfg in _by_role().values():
        ports = {p["containerPort"] for p in server.container["ports"]}
        assert cfg.http_port in ports, f"{server.name}: container ports {ports} lack {cfg.http_port}"
        if cfg.role == "ce":
            kv_ports = {cfg.kv_port_base + rank for rank in range(cfg.dp)}
            assert kv_ports <= ports, f"{server.name}: container ports {ports} lack the KV ports {kv_ports}"
        resources = server.container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == cfg.dp, f"{server.name}: one GPU per rank (--dp)"
        assert resources["requests"]["nvidia.com/gpu"] == cfg.dp
        assert {"cpu", "memory"} <= set(resources["requests"])
        mounts = {m["mountPath"]: m["name"] for m in server.container["volumeMounts"]}
        volumes = {v["name"]: v for v in server.pod["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_the_ce_advertises_its_pod_ip_for_kv() -> None:
    _, cfg = _by_role()["ce"]
    assert cfg.kv_host == "0.0.0.0"
    assert cfg.kv_advertise_host == POD_IP, "--kv-advertise-host must be $(POD_IP) (status.podIP)"


def test_services_reach_the_servers_ports() -> None:
    http_ports = _http_ports()
    for service in _of_kind("Service"):
        targets = [(s, port) for s, port in http_ports if _selects(service, s)]
        assert len(targets) == 1, f"Service/{service['metadata']['name']} selects {len(targets)} workloads"
        server, http_port = targets[0]
        for port in service["spec"]["ports"]:
            target = server.port_number(port.get("targetPort", port["port"]))
            assert target == http_port, f"Service/{service['metadata']['name']} targets {target}"
    ce_services = [s for s in _of_kind("Service") if _selects(s, _by_role()["ce"][0])]
    assert len(ce_services) == 2, "the CEs need pdserve-ce (one virtual IP) and a headless Service (the router's)"
    for service in ce_services:
        assert [p["name"] for p in service["spec"]["ports"]] == ["http"], service["metadata"]["name"]


def test_the_ce_finds_the_pes_through_the_headless_service() -> None:
    roles = _by_role()
    pe, pe_cfg = roles["pe"]
    headless = [s for s in _of_kind("Service") if s["spec"].get("clusterIP") == "None" and _selects(s, pe)]
    assert len(headless) == 1, "the PEs need one headless Service (clusterIP: None)"
    service = headless[0]
    name = service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert port["port"] == pe_cfg.http_port
    assert pe.workload["kind"] != "StatefulSet" or pe.workload["spec"]["serviceName"] == name
    urls = [urlsplit(u.strip()) for u in roles["ce"][1].prefill_url.split(",")]
    dns = [u for u in urls if u.scheme == "dns+http"]
    assert dns, f"--prefill-url {roles['ce'][1].prefill_url!r} has no dns+http:// entry"
    for url in dns:
        # The short name resolves in the pod's own namespace; a qualified one must name it too.
        assert url.hostname is not None and url.hostname.split(".")[0] == name, url.geturl()
        assert url.port == port["port"], url.geturl()


# ---- the router ----------------------------------------------------------------------------------


def test_every_container_is_a_server_or_the_router() -> None:
    from pd.tools.cli import COMMANDS

    assert not OTHER_CONTAINERS, f"containers that run neither `pdserve serve` nor `pdserve router`: {OTHER_CONTAINERS}"
    assert "router" in COMMANDS, "`pdserve router` is a subcommand of the image's entrypoint"


def test_args_are_router_flags() -> None:
    router, cfg = _the_router()
    assert router.workload["kind"] == "Deployment", "the router is stateless"
    assert cfg.host == "0.0.0.0", f"{router.name}: --host must be reachable from other pods"


def test_the_routers_probes_ask_its_routes_on_its_port() -> None:
    router, cfg = _the_router()
    routes = router_get_routes(cfg)
    assert {"/health/live", "/health/ready", "/metrics"} <= routes, routes
    c = router.container
    # /health and /health/ready answer 503 until a CE is up (minutes, while CEs load the model): a
    # startup probe on them would restart the router meanwhile.
    expected = {"startupProbe": "/health/live", "readinessProbe": "/health/ready", "livenessProbe": "/health/live"}
    for kind, path in expected.items():
        probe = c[kind]["httpGet"]
        assert probe["path"] in routes, f"{router.name}: {kind} asks {probe['path']}, which the router passes to a CE"
        assert probe["path"] == path, f"{router.name}: {kind} must ask {path}"
        assert router.port_number(probe["port"]) == cfg.port, f"{router.name}: {kind} port"


def test_the_router_listens_on_its_container_port_without_a_gpu() -> None:
    router, cfg = _the_router()
    ports = {p["containerPort"] for p in router.container["ports"]}
    assert cfg.port in ports, f"{router.name}: container ports {ports} lack {cfg.port}"
    resources = router.container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    for part in ("requests", "limits"):
        assert "nvidia.com/gpu" not in resources.get(part, {}), f"{router.name}: the router needs no GPU"
    assert not router.pod["spec"].get("volumes"), f"{router.name}: the router reads no model"


def test_clients_reach_the_router_through_its_service() -> None:
    router, cfg = _the_router()
    services = [s for s in _of_kind("Service") if _selects(s, router)]
    assert [s["metadata"]["name"] for s in services] == ["pdserve-router"], "docs/guides/kubernetes.md names this Service"
    (service,) = services
    assert service["spec"].get("clusterIP") != "None" and service["spec"]["type"] in ("ClusterIP", "LoadBalancer")
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"]) == ("http", 80), port
    assert router.port_number(port["targetPort"]) == cfg.port


def test_the_router_finds_every_ce_through_the_headless_service() -> None:
    router, cfg = _the_router()
    ce, ce_cfg = _by_role()["ce"]
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")}
    targets = parse_targets(cfg.decode_url, "--decode-url")
    # A fixed URL names one pod (or one virtual IP): the router would not see the CEs a scale-up adds.
    assert targets and all(t.dns and t.scheme == "http" for t in targets), cfg.decode_url
    for target in targets:
        # The short name resolves in the pod's own namespace; a qualified one must name it too.
        name = target.host.split(".")[0]
        assert name in services, f"--decode-url {target.url}: no Service {name!r} in the base"
        service = services[name]
        # A ClusterIP Service resolves to one virtual IP, behind which kube-proxy spreads a conversation's
        # turns over the CEs; a headless one to every ready CE pod, each a CE the router hashes over.
        assert service["spec"].get("clusterIP") == "None", f"Service/{name} must be headless (clusterIP: None)"
        assert not service["spec"].get("publishNotReadyAddresses"), f"Service/{name}: ready CEs only"
        assert _selects(service, ce), f"Service/{name} does not select the CE pods"
        ports = [p for p in service["spec"]["ports"] if p["port"] == target.port]
        assert len(ports) == 1, f"--decode-url {target.url}: Service/{name} has no port {target.port}"
        (port,) = ports
        assert ce.port_number(port.get("targetPort", port["port"])) == ce_cfg.http_port, target.url
        # DNS gives pod IPs: the router connects to the pods' port, not the Service's.
        assert target.port == ce_cfg.http_port, f"--decode-url {target.url}: the CEs listen on {ce_cfg.http_port}"


def _pre_stop_s(container: dict[str, Any]) -> int:
    """How long the container's preStop hook sleeps: `exec: sleep N` (any Kubernetes) or the `sleep`
    action (1.30+)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "exec" in hook:
        command = hook["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2, command
        return int(command[1])
    return int(hook.get("sleep", {}).get("seconds", 0))


def test_the_grace_period_covers_the_drain() -> None:
    router, router_cfg = _the_router()
    drains: list[tuple[Pdserve, float]] = [(s, cfg.shutdown_timeout_s + RANK_STOP_S) for s, cfg in _by_role().values()]
    drains.append((router, router_cfg.shutdown_timeout_s + ROUTER_STOP_S))
    for server, drain_s in drains:
        pod = server.pod["spec"]
        pre_stop = _pre_stop_s(server.container)
        assert pre_stop > 0, f"{server.name}: a preStop pause lets Services and DNS drop the pod first"
        needed = pre_stop + drain_s
        assert pod["terminationGracePeriodSeconds"] >= needed, f"{server.name}: grace < {needed} s"


def test_the_token_comes_from_the_secret_and_its_placeholder_is_refused() -> None:
    (secret,) = [s for s in _of_kind("Secret") if s["metadata"]["name"] == "pdserve-cluster-token"]
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    for server in SERVERS:
        (var,) = [v for v in server.container["env"] if v["name"] == "PDSERVE_CLUSTER_TOKEN"]
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, f"{server.name}: {ref}"
    # A base applied without replacing the placeholder must not start with a guessable token.
    for value in secret.get("stringData", {}).values():
        with pytest.raises(ValueError):
            load_token(value)


# ---- the model cache, the image's user, disruptions -----------------------------------------------


def _plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["value"] for v in container.get("env", []) if "value" in v}


def _fetcher(server: Server) -> dict[str, Any]:
    """The server pod's init container that runs `pdserve download MODEL`."""
    found = [c for c in server.pod["spec"].get("initContainers", []) if command_of(c)[:2] == ["pdserve", "download"]]
    assert len(found) == 1, f"{server.name}: one init container must run `pdserve download`"
    return found[0]


def test_the_init_container_fills_the_cache_the_server_reads_offline() -> None:
    from engine.checkpoints.hub import parse_hub_model
    from pd.tools.cli import COMMANDS

    assert "download" in COMMANDS and image_entrypoint() == ["pdserve"]
    claims = {c["metadata"]["name"]: c for c in _of_kind("PersistentVolumeClaim")}
    for server, cfg in _by_role().values():
        fetch = _fetcher(server)
        assert fetch["image"] == server.container["image"]
        assert expanded_command(fetch) == ["pdserve", "download", cfg.engine.model], "the server's model"
        volumes = {v["name"]: v for v in server.pod["spec"]["volumes"]}
        fetch_mounts = {m["name"]: m for m in fetch["volumeMounts"]}
        server_mounts = {m["name"]: m for m in server.container["volumeMounts"]}
        (name,) = [n for n in fetch_mounts if "persistentVolumeClaim" in volumes[n]]
        claim = claims[volumes[name]["persistentVolumeClaim"]["claimName"]]
        assert "ReadWriteMany" in claim["spec"]["accessModes"], "every PE and CE pod mounts the one cache"
        path = fetch_mounts[name]["mountPath"]
        assert server_mounts[name]["mountPath"] == path and not fetch_mounts[name].get("readOnly")
        fetch_env, server_env = _plain_env(fetch), _plain_env(server.container)
        for var in ("HF_HOME", "PDSERVE_HOME"):  # the same cache on both sides, on the volume
            assert fetch_env[var] == server_env[var] and fetch_env[var].startswith(path + "/"), var
        assert server_env.get("HF_HUB_OFFLINE") == "1", f"{server.name}: the server reads the filled cache only"
    assert parse_hub_model(cfg.engine.model) is not None, "the base serves a model from the hub"


def test_init_container_then_server_on_a_fake_hub(tmp_path: Path) -> None:
    """The init container's command and env, then the server's resolution with its env (offline), run for
    real against a fake hub serving the base's model id, the volume a temporary folder: the second finds
    what the first downloaded, without the hub."""
    import os
    import sys

    from engine.checkpoints import models_home
    from tests.fake_hub import FakeHub, Repo, commit_of, files_of
    from tests.tiny_models import make_servable

    server, cfg = _by_role()["ce"]
    fetch = _fetcher(server)
    (mount,) = [m["mountPath"] for m in fetch["volumeMounts"]]
    volume = tmp_path / "volume"

    def env_of(container: dict[str, Any], endpoint: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDSERVE_HOME"))}
        for var, value in _plain_env(container).items():
            env[var] = value.replace(mount, str(volume), 1) if value.startswith(mount) else value
        return {**env, "HF_ENDPOINT": endpoint}

    checkpoint = make_servable("qwen3", tmp_path / "checkpoint", models_home() / "smollm2-135m-instruct")
    files = files_of(checkpoint)
    with FakeHub({cfg.engine.model: Repo(files, commit_of(files))}) as hub:
        cli = [sys.executable, "-m", "pd.tools.cli", *expanded_command(fetch)[1:]]
        first = subprocess.run(cli, env=env_of(fetch, hub.url), capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        asked = len(hub.requests)
        resolve = [sys.executable, "-m", "pd.tools.cli", "download", cfg.engine.model]
        second = subprocess.run(resolve, env=env_of(server.container, hub.url), capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        assert len(hub.requests) == asked, "the server's side asked the hub"
    folder = Path(second.stdout.strip())
    assert folder == Path(first.stdout.strip()) and folder.is_relative_to(volume)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_pods_run_as_the_images_user() -> None:
    (user,) = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")]
    uid, gid = (int(x) for x in user.split(":"))
    for server, _ in _http_ports():
        security = server.pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
        assert server.container["securityContext"]["allowPrivilegeEscalation"] is False, server.name
    for server, _ in _by_role().values():
        security = server.pod["spec"]["securityContext"]
        assert security["fsGroup"] == gid, f"{server.name}: the user must be able to write the model volume"


def test_a_disruption_budget_covers_each_role() -> None:
    budgets = _of_kind("PodDisruptionBudget")
    for server, _ in _http_ports():
        labels = server.pod["metadata"]["labels"]
        matching = [b for b in budgets if all(labels.get(k) == v for k, v in b["spec"]["selector"]["matchLabels"].items())]
        assert len(matching) == 1, f"{server.name}: {len(matching)} PodDisruptionBudgets select it"
        assert matching[0]["spec"].get("maxUnavailable") == 1
