"""deploy/k8s, checked offline (no cluster runs here): the Kubernetes schemas, the cert-manager schema kept
in the repo, and the code (settings, ports, identities), for the base and the GPU overlay. Each check is
also shown to fire on a manifest broken the way it guards against."""

from __future__ import annotations

import copy

import pytest

from agentgw import k8scheck

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return k8scheck.render(k8scheck.ROOT / "base")


def _find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs: list[dict], kind: str, name: str) -> dict:
    return _find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict, name: str) -> dict:
    return next(e for e in container["env"] if e["name"] == name)


def test_the_base_and_the_gpu_overlay_hold():
    assert k8scheck.main([]) == 0
    for directory in k8scheck.DEFAULT_DIRS:
        assert k8scheck.check(k8scheck.render(directory)) == []


def test_the_deployment_has_what_the_issue_asks_for(base):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in base}
    assert {("Deployment", "agw-gateway"), ("HorizontalPodAutoscaler", "agw-gateway"), ("Service", "agw-gateway"),
            ("PodDisruptionBudget", "agw-gateway"), ("StatefulSet", "agw-inference"), ("Service", "agw-inference"),
            ("Deployment", "agw-retrieval"), ("StatefulSet", "agw-qdrant"), ("Deployment", "agw-otel-collector"),
            ("Deployment", "agw-jaeger"), ("Issuer", "agw-ca"), ("Certificate", "agw-gateway")} <= kinds
    assert _find(base, "Service", "agw-gateway")["spec"]["ports"][0]["appProtocol"] == "grpc"
    assert _find(base, "Service", "agw-inference")["spec"]["clusterIP"] == "None"
    assert _find(base, "Deployment", "agw-retrieval")["spec"]["replicas"] > 1
    assert "AGW_QDRANT_URL" in {e["name"] for e in _container(base, "Deployment", "agw-retrieval")["env"]}
    gateway = _container(base, "Deployment", "agw-gateway")
    assert _env(gateway, "AGW_DATABASE_URL")["valueFrom"]["secretKeyRef"]["name"] == "agw-database"
    assert int(_env(gateway, "AGW_GATEWAY_MAX_CONNECTION_AGE_S")["value"]) > 0
    inference = _container(base, "StatefulSet", "agw-inference")
    startup = inference["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    assert all(d["metadata"]["namespace"] == "agw" for d in base if d["kind"] != "Namespace")


def test_equal_quantities_in_other_units_are_guaranteed(base):
    # Kubernetes compares quantities, not their spelling: 4000m is 4 CPUs, 8192Mi is 8Gi.
    def spelled_otherwise(docs):
        resources = _container(docs, "StatefulSet", "agw-inference")["resources"]
        resources["requests"].update(cpu="4000m", memory="8192Mi")
        resources["limits"].update(cpu="4", memory="8Gi")
    assert _broken(base, spelled_otherwise) == []

    def requests_left_to_the_limits(docs):  # Kubernetes sets a missing request to its limit
        _container(docs, "StatefulSet", "agw-inference")["resources"]["requests"].pop("cpu")
    assert _broken(base, requests_left_to_the_limits) == []


def test_the_gpu_overlay_asks_for_a_gpu_and_a_model():
    inference = _container(k8scheck.render(k8scheck.ROOT / "overlays" / "gpu"), "StatefulSet", "agw-inference")
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert inference["image"].startswith("registry.example.com/agent-gateway-gpu:")
    names = [e["name"] for e in inference["env"]]
    assert "AGW_MODEL" in names and "AGW_INFERENCE_REPLICA_NAME" in names  # merged, not replaced


def _broken(docs: list[dict], change) -> list[str]:
    docs = copy.deepcopy(docs)
    change(docs)
    return k8scheck.check(docs)


@pytest.mark.parametrize(("change", "expected"), [
    # The Kubernetes schemas, strict, and the cert-manager schema kept in the repo.
    (lambda d: _find(d, "Deployment", "agw-gateway")["spec"].update(replica=3), "replica"),
    (lambda d: _container(d, "Deployment", "agw-gateway").update(imagePullPolicy=7), "Deployment/agw-gateway"),
    (lambda d: _find(d, "Certificate", "agw-gateway")["spec"].update(dnsName=["x"]), "Certificate/agw-gateway"),
    (lambda d: _find(d, "Certificate", "agw-gateway")["spec"].update(usages=["server"]), "Certificate/agw-gateway"),
    # The code: settings, ports, targets.
    (lambda d: _container(d, "Deployment", "agw-gateway")["env"].append({"name": "AGW_GATEWAY_WORKRES", "value": "1"}),
     "AGW_GATEWAY_WORKRES is not a setting of the gateway service"),
    (lambda d: _env(_container(d, "StatefulSet", "agw-inference"), "AGW_INFERENCE_PORT").update(value="50099"),
     "AGW_INFERENCE_PORT (50099) is not one of its container ports"),
    (lambda d: _env(_container(d, "Deployment", "agw-gateway"), "AGW_GATEWAY_INFERENCE_TARGETS").update(
        value="dns:///agw-inference.agw.svc.cluster.local:50099"), "the Service does not forward port 50099"),
    (lambda d: _env(_container(d, "Deployment", "agw-gateway"), "AGW_GATEWAY_RETRIEVAL_TARGET").update(
        value="search:50052"), "names no Service selecting the retrieval pods"),
    (lambda d: _find(d, "Service", "agw-inference")["spec"].pop("clusterIP"), "needs a headless Service"),
    # Identities: each its own folder, from its own Certificate.
    (lambda d: _find(d, "Certificate", "agw-inference")["spec"].update(uris=["spiffe://agentgw.local/service/gateway"]),
     "not ['spiffe://agentgw.local/service/inference']"),
    (lambda d: _container(d, "Deployment", "agw-retrieval")["volumeMounts"].append(
        {"name": "tls", "mountPath": "/tls/service/gateway", "readOnly": True}), "must mount exactly its own identity"),
    (lambda d: _container(d, "Deployment", "agw-gateway")["volumeMounts"][0].update(readOnly=False),
     "must mount exactly its own identity folder /tls/service/gateway, read-only"),
    # Probes, shutdown, hardening.
    (lambda d: _container(d, "Deployment", "agw-gateway").update(readinessProbe={"grpc": {"port": 50051}}),
     "readinessProbe must run python -m agentgw.healthcheck"),
    (lambda d: _find(d, "Deployment", "agw-gateway")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=20),
     "terminationGracePeriodSeconds 20 < preStop 5 s + AGW_GRACE_S 25"),
    (lambda d: _container(d, "Deployment", "agw-retrieval")["securityContext"].update(readOnlyRootFilesystem=False),
     "readOnlyRootFilesystem true"),
    (lambda d: _container(d, "Deployment", "agw-retrieval")["resources"].pop("limits"), "requests and limits"),
    (lambda d: _container(d, "Deployment", "agw-jaeger").update(image="jaegertracing/all-in-one:latest"),
     "is not pinned"),
    # The engine's pod is Guaranteed, with whole CPUs, so a static CPU manager gives it CPUs of its own.
    (lambda d: _container(d, "StatefulSet", "agw-inference")["resources"]["limits"].update(memory="12Gi"),
     "the inference pod must be Guaranteed: inference's memory request (8Gi) must equal its limit (12Gi)"),
    (lambda d: _container(d, "StatefulSet", "agw-inference")["resources"]["limits"].pop("cpu"),
     "inference's cpu request (4) must equal its limit (None)"),
    (lambda d: [_container(d, "StatefulSet", "agw-inference")["resources"][k].update(cpu="3500m")
                for k in ("requests", "limits")], "CPU limit 3500m is not a whole number"),
    # The network: backends admit the gateway only.
    (lambda d: d.remove(_find(d, "NetworkPolicy", "default-deny-ingress")), "no default deny"),
    (lambda d: _find(d, "NetworkPolicy", "inference-ingress")["spec"]["ingress"][0].pop("from"),
     "agw-inference's port 50053 must admit the gateway's pods only"),
])
def test_each_check_fires(base, change, expected):
    problems = _broken(base, change)
    assert any(expected in problem for problem in problems), problems


# The edge: components/edge, in overlays/edge over the base.

@pytest.fixture(scope="module")
def with_edge() -> list[dict]:
    return k8scheck.render(k8scheck.ROOT / "overlays" / "edge")


def _edge_pod(docs: list[dict]) -> dict:
    return _find(docs, "Deployment", "agw-edge")["spec"]["template"]["spec"]


def _edge_job_args(docs: list[dict]) -> list:
    return _edge_pod(docs)["initContainers"][0]["args"]


def _set(args: list, flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _drop(args: list, flag: str) -> None:
    del args[args.index(flag):args.index(flag) + 2]


def test_the_edge_overlay_puts_envoy_in_front(with_edge):
    assert k8scheck.check(with_edge) == []
    pod = _edge_pod(with_edge)
    assert pod["containers"][0]["image"] == "envoyproxy/envoy:v1.40.0"
    assert pod["initContainers"][0]["image"] == "registry.example.com/agent-gateway:0.1.0"
    assert _find(with_edge, "Service", "agw-edge")["spec"]["ports"][0]["port"] == 50051
    for kind, name in (("Deployment", "agw-gateway"), ("StatefulSet", "agw-inference"), ("Deployment", "agw-retrieval")):
        service = name.removeprefix("agw-").upper()
        assert _env(_container(with_edge, kind, name), f"AGW_{service}_EDGE_CLIENTS")["value"] == "service/edge"
        # Merged into the base's environment, not replacing it.
        assert _env(_container(with_edge, kind, name), "AGW_TLS_DIR")["value"] == "/tls"
    assert _find(with_edge, "Certificate", "agw-edge")["spec"]["uris"] == ["spiffe://agentgw.local/service/edge"]
    assert all(d["metadata"]["namespace"] == "agw" for d in with_edge if d["kind"] != "Namespace")


def test_the_edge_init_containers_arguments_make_a_bootstrap_envoy_accepts(with_edge, pki, tmp_path):
    """Its own arguments, with the test PKI for /tls and a folder here for /edge."""
    from tests.support.edge import assert_edge_config_loads

    assert_edge_config_loads(_edge_job_args(with_edge), pki.root, tmp_path)


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: _container(d, "StatefulSet", "agw-inference")["env"].remove(
        _env(_container(d, "StatefulSet", "agw-inference"), "AGW_INFERENCE_EDGE_CLIENTS")),
     "StatefulSet/agw-inference/inference: AGW_INFERENCE_EDGE_CLIENTS does not name service/edge: it would refuse "
     "what the edge forwards (Generate and Retrieve: UNIMPLEMENTED)"),
    (lambda d: _set(_edge_job_args(d), "--inference", "agw-inference.agw.svc.cluster.local:50099"),
     "the Service does not forward port 50099"),
    (lambda d: _set(_edge_job_args(d), "--gateway", "agw-gateway.agw.svc.cluster.local:50051"),
     "'agw-gateway.agw.svc.cluster.local:50051' needs a headless Service"),
    (lambda d: _set(_edge_job_args(d), "--retrieval", "agw-qdrant.agw.svc.cluster.local:6334"),
     "names no Service selecting the retrieval pods"),
    (lambda d: _set(_edge_job_args(d), "--listen", "0.0.0.0:8443"), "listens on '8443' (--listen)"),
    (lambda d: _set(_edge_job_args(d), "--metrics", "0.0.0.0:9999"), "listens on '9999' (--metrics)"),
    (lambda d: _set(_edge_job_args(d), "--out", "/tmp/envoy.json"), "writes '/tmp/envoy.json'"),
    (lambda d: _edge_pod(d)["containers"][0]["volumeMounts"][1].update(mountPath="/config"),
     "mount its volume at the same path"),
    (lambda d: _edge_pod(d)["initContainers"].clear(), "no init container runs 'edge-config'"),
    (lambda d: _set(_edge_job_args(d), "--max-heap-mib", "480"),
     "--max-heap-mib 480 is over 80% of the container's memory limit (512Mi): it would be OOM-killed"),
    (lambda d: _drop(_edge_job_args(d), "--max-heap-mib") or _edge_pod(d)["containers"][0]["resources"]["limits"]
     .update(memory="256Mi"), "--max-heap-mib 384 is over 80% of the container's memory limit (256Mi)"),
    (lambda d: _find(d, "Certificate", "agw-edge")["spec"].update(uris=["spiffe://agentgw.local/service/gateway"]),
     "not ['spiffe://agentgw.local/service/edge']"),
    (lambda d: _edge_pod(d)["containers"][0]["volumeMounts"][0].update(mountPath="/tls"),
     "must mount exactly its own identity folder /tls/service/edge"),
    (lambda d: _edge_pod(d)["initContainers"][0]["securityContext"].update(readOnlyRootFilesystem=False),
     "Deployment/agw-edge/edge-config: set allowPrivilegeEscalation false and readOnlyRootFilesystem true"),
    (lambda d: _edge_pod(d)["containers"][0].update(image="envoyproxy/envoy:latest"), "is not pinned"),
    # One door into the gateway, and the backends admit the gateway and the edge only.
    (lambda d: _find(d, "NetworkPolicy", "gateway-ingress")["spec"]["ingress"][0].pop("from"),
     "agw-gateway's port 50051 must admit the edge's pods only"),
    (lambda d: d.remove(_find(d, "NetworkPolicy", "retrieval-from-edge")),
     "agw-retrieval's port 50052 must admit the gateway and edge's pods only"),
    (lambda d: _find(d, "Deployment", "agw-edge")["metadata"].pop("namespace"), "no namespace"),
    # A stop drains first: through the admin port, waiting out the drain, within the grace.
    (lambda d: _drop(_edge_job_args(d), "--admin"),
     "no --admin for edge-config: nothing can drain Envoy"),
    (lambda d: _edge_pod(d)["containers"][0]["lifecycle"].update(preStop={"exec": {"command": ["sleep", "5"]}}),
     "its preStop does not POST /drain_listeners?graceful to the admin port 127.0.0.1:9901"),
    (lambda d: _set(_edge_pod(d)["containers"][0]["args"], "--drain-time-s", "30"),
     "its preStop waits 20 s after the drain starts, less than --drain-time-s 30"),
    (lambda d: _edge_pod(d).update(terminationGracePeriodSeconds=20),
     "terminationGracePeriodSeconds 20 < its preStop's 25 s"),
])
def test_each_edge_check_fires(with_edge, change, expected):
    problems = _broken(with_edge, change)
    assert any(expected in problem for problem in problems), problems


def test_a_component_must_say_so(tmp_path):
    (tmp_path / "component").mkdir()
    (tmp_path / "component" / "kustomization.yaml").write_text("kind: Kustomization\nresources: []\n")
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncomponents: [component]\n")
    with pytest.raises(ValueError, match="must say kind: Component"):
        k8scheck.render(tmp_path)
