"""Static checks of ``deploy/k8s`` against the Kubernetes schemas and the code, for machines without a cluster.

``python -m agentgw.k8scheck [KUSTOMIZATION_DIR ...]`` renders each
kustomization (the subset of kustomize these manifests use: ``resources``,
``namespace``, ``labels``, ``images`` and strategic-merge ``patches``), prints
one line per problem, and exits 1 if there are any. What it holds them to:

- every core resource is valid against the Kubernetes OpenAPI schemas
  (``kubernetes-validate``, strict: unknown fields are errors); cert-manager's
  Issuers and Certificates against ``deploy/k8s/schemas/cert-manager.io-v1.json``;
- every ``AGW_*`` variable given to one of our containers is a setting of its
  service, the container listens on its ``AGW_*_PORT`` and metrics port, and
  every target names a Service of the manifests, on its port, selecting that
  service's pods (the inference target through the headless Service);
- each of our containers mounts, read-only, exactly its own identity's folder
  (``/tls/service/<name>``) from the Secret of a Certificate whose one URI is
  that identity, as ``cert.pem``, ``key.pem`` and ``ca.pem``;
- probes (startup, readiness, liveness) run the mTLS health check client;
  ``terminationGracePeriodSeconds`` covers ``preStop`` plus ``AGW_GRACE_S``;
  requests and limits are set; pods run non-root, containers without
  privilege escalation and on a read-only root filesystem; images are pinned;
- the inference pod is in the Guaranteed QoS class (requests equal to limits,
  whole CPUs), so a node's static CPU manager gives the engine CPUs of its own;
- NetworkPolicies deny ingress by default, and the backends' ports admit the
  gateway's pods only (and the edge's, where there is one);
- an edge (``components/edge``: Envoy, with the bootstrap an ``agentgw
  edge-config`` init container writes) runs that bootstrap from the path it
  was written at, keeps its heap bound (``--max-heap-mib``) within 80% of
  its memory limit, mounts exactly ``/tls/service/edge`` from the edge's
  Certificate, reaches each service through a headless Service selecting its
  pods on its port, is the only way into the gateway's port, and is believed
  by every service of ours (``AGW_<SERVICE>_EDGE_CLIENTS``), or the backends
  would answer it ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from pathlib import Path

import yaml

from agentgw.composecheck import (EDGE_CONFIG_COMMAND, EDGE_IMAGE, SETTINGS, _pinned, _settings_class,
                                  drain_problems, option, unbelieved_edge,
                                  unexposed_listeners)
from agentgw.edge import DEFAULT_MAX_HEAP_MIB
from servicekit.identity import DEFAULT_TRUST_DOMAIN
from servicekit.settings import environment_names

ROOT = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
DEFAULT_DIRS = (ROOT / "base", ROOT / "overlays" / "gpu", ROOT / "overlays" / "edge")
CERT_MANAGER_SCHEMA = ROOT / "schemas" / "cert-manager.io-v1.json"
#: The Kubernetes release whose schemas the manifests are held to.
KUBERNETES_VERSION = "1.31.0"
CLUSTER_SCOPED = {"Namespace", "ClusterIssuer", "ClusterRole", "ClusterRoleBinding"}
#: The probe every container of ours must run: the mTLS health check client.
HEALTHCHECK = ["python", "-m", "agentgw.healthcheck"]


def _merge(base, patch):
    """A strategic merge, as kustomize does it for what these manifests patch: maps merge, lists of named
    maps (containers, env, volumes, ports) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(item, dict) and "name" in item for item in [*base, *patch])):
        merged = {item["name"]: item for item in base}
        for item in patch:
            merged[item["name"]] = _merge(merged[item["name"]], item) if item["name"] in merged else item
        return list(merged.values())
    return patch


def _resources(directory: Path, kustomization: dict) -> list[dict]:
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _patched(directory: Path, kustomization: dict, docs: list[dict]) -> list[dict]:
    for patch in kustomization.get("patches", []):
        change = yaml.safe_load((directory / patch["path"]).read_text())
        matches = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                   (change["kind"], change["metadata"]["name"])]
        if len(matches) != 1:
            raise ValueError(f"{directory}: patch {patch['path']} matches {len(matches)} resources")
        docs[matches[0]] = _merge(docs[matches[0]], change)
    return docs


def render(directory: Path) -> list[dict]:
    """The resources of the kustomization in ``directory``. A component (``components``) adds its resources to
    what came before and patches them, then the kustomization's own patches apply, as kustomize orders them."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = _resources(directory, kustomization)
    for component in kustomization.get("components", []):
        path = directory / component
        spec = yaml.safe_load((path / "kustomization.yaml").read_text())
        if spec.get("kind") != "Component":
            raise ValueError(f"{path}: a component's kustomization must say kind: Component")
        docs = _patched(path, spec, docs + _resources(path, spec))
    docs = _patched(directory, kustomization, docs)
    images = {image["name"]: f"{image['newName']}:{image['newTag']}" for image in kustomization.get("images", [])}
    for doc in docs:
        if kustomization.get("namespace") and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for pairs in kustomization.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(pairs["pairs"])
        for container in _containers(doc, init=True):
            container["image"] = images.get(container["image"], container["image"])
    return docs


def _pod(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "StatefulSet") else None


def _containers(doc: dict, init: bool = False) -> list[dict]:
    """The pod's containers (and its init containers first, with ``init``)."""
    pod = _pod(doc)
    return [*(pod.get("initContainers", []) if init else []), *pod["containers"]] if pod else []


def _served(container: dict) -> str | None:
    args = container.get("args") or []
    return args[1] if len(args) >= 2 and args[0] == "serve" and args[1] in SETTINGS else None


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check_schemas(docs: list[dict]) -> list[str]:
    import jsonschema
    import kubernetes_validate

    cert_manager = json.loads(CERT_MANAGER_SCHEMA.read_text())
    problems = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            if doc["apiVersion"].startswith("cert-manager.io/"):
                jsonschema.validate(doc, cert_manager)
            else:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            problems.append(f"{where}: {getattr(exc, 'message', exc)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: no schema for it ({exc})")
    return problems


def check(docs: list[dict]) -> list[str]:
    """Every problem found in rendered manifests; an empty list means they hold."""
    problems = check_schemas(docs)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    certificates = {d["spec"]["secretName"]: d for d in docs if d["kind"] == "Certificate"}
    for doc in docs:
        for container in _containers(doc, init=True):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            if not _pinned(container["image"]):
                problems.append(f"{where}: image {container['image']!r} is not pinned to a version")
            problems += _check_hardening(where, doc, container)
            service = _served(container)
            if service is not None:
                problems += _check_ours(where, doc, container, service, services, docs, certificates)
            if container["image"].startswith(EDGE_IMAGE):
                problems += _check_edge(where, doc, container, services, docs, certificates)
    problems += _check_network(docs)
    homeless = [f"{d['kind']}/{d['metadata']['name']}" for d in docs
                if d["kind"] not in CLUSTER_SCOPED and not d["metadata"].get("namespace")]
    if homeless:
        problems.append(f"no namespace (set one in the kustomization that brings them): {', '.join(homeless)}")
    return problems


def _check_hardening(where: str, doc: dict, container: dict) -> list[str]:
    problems = []
    pod = _pod(doc)
    if not (pod.get("securityContext") or {}).get("runAsNonRoot"):
        problems.append(f"{where}: the pod does not set runAsNonRoot")
    security = container.get("securityContext") or {}
    if security.get("allowPrivilegeEscalation") is not False or not security.get("readOnlyRootFilesystem"):
        problems.append(f"{where}: set allowPrivilegeEscalation false and readOnlyRootFilesystem true")
    resources = container.get("resources") or {}
    if not resources.get("requests") or not resources.get("limits"):
        problems.append(f"{where}: resource requests and limits must both be set")
    return problems


def _check_ours(where, doc, container, service, services, docs, certificates) -> list[str]:
    problems = []
    env = _env(container)
    known = set(environment_names(_settings_class(service)))
    problems += [f"{where}: {v} is not a setting of the {service} service" for v in sorted(env)
                 if v.startswith("AGW_") and v not in known]
    ports = {p["containerPort"] for p in container.get("ports", [])}
    for variable in (f"AGW_{service.upper()}_PORT", f"AGW_{service.upper()}_METRICS_PORT"):
        if env.get(variable) is None or int(env[variable]) not in ports:
            problems.append(f"{where}: {variable} ({env.get(variable)}) is not one of its container ports {sorted(ports)}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if ((container.get(probe) or {}).get("exec") or {}).get("command") != HEALTHCHECK:
            problems.append(f"{where}: {probe} must run {' '.join(HEALTHCHECK)} (the mTLS health check client)")
    pre_stop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", [])
    pause = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    grace = float(env.get("AGW_GRACE_S") or 10)
    period = _pod(doc).get("terminationGracePeriodSeconds", 30)
    if period < pause + grace:
        problems.append(f"{where}: terminationGracePeriodSeconds {period} < preStop {pause} s + AGW_GRACE_S {grace:g}")
    problems += _check_identity(where, doc, container, service, certificates)
    if service == "gateway":
        problems += _check_targets(where, env, services, docs)
    if service == "inference":
        problems += _check_guaranteed(where, doc)
    return problems


#: Binary and decimal suffixes of a Kubernetes quantity, as multipliers.
_QUANTITY_SUFFIXES = {"m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
                      "G": Fraction(10**9), "T": Fraction(10**12), "Ki": Fraction(2**10), "Mi": Fraction(2**20),
                      "Gi": Fraction(2**30), "Ti": Fraction(2**40)}


def _quantity(value) -> Fraction | None:
    """A resource quantity's value (``"500m"`` is 1/2, ``"8Gi"`` 8 * 2**30), or None when it is not one."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(value))
    if not match or match[2] not in _QUANTITY_SUFFIXES:
        return None
    return Fraction(match[1]) * _QUANTITY_SUFFIXES[match[2]]


def _check_guaranteed(where: str, doc: dict) -> list[str]:
    """The inference pod is in the Guaranteed QoS class, with whole CPUs.

    On a node whose kubelet runs the static CPU manager, only such a pod's
    containers get CPUs of their own. The engine needs them: on shared cores
    its worker's step waits behind the other processes (docs/benchmarks.md,
    "The engine worker's core to itself"). And the engine takes its KV cache up
    front, so a memory request under the limit would let the node be
    overcommitted by what the pod is sure to use.
    """
    problems = []
    for container in _containers(doc, init=True):
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in ("cpu", "memory"):
            request, limit = requests.get(resource), limits.get(resource)
            if limit is None or _quantity(request if request is not None else limit) != _quantity(limit):
                problems.append(f"{where}: the inference pod must be Guaranteed: {container['name']}'s {resource} "
                                f"request ({request}) must equal its limit ({limit})")
        cpu = _quantity(limits.get("cpu"))
        if cpu is not None and cpu.denominator != 1:
            problems.append(f"{where}: {container['name']}'s CPU limit {limits['cpu']} is not a whole number: the "
                            "static CPU manager gives CPUs of their own only to whole CPUs in a Guaranteed pod")
    return problems


def _check_identity(where, doc, container, service, certificates, tls_dir: str | None = None) -> list[str]:
    tls_dir = tls_dir or _env(container).get("AGW_TLS_DIR") or "/tls"
    own = f"{tls_dir}/service/{service}"
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].startswith(tls_dir)]
    if [m["mountPath"] for m in mounts] != [own] or not mounts[0].get("readOnly"):
        return [f"{where}: must mount exactly its own identity folder {own}, read-only (got "
                f"{[m['mountPath'] for m in mounts]})"]
    volume = next((v for v in _pod(doc).get("volumes", []) if v["name"] == mounts[0]["name"]), {})
    secret = volume.get("secret") or {}
    items = {item["key"]: item["path"] for item in secret.get("items", [])}
    problems = []
    if items != {"tls.crt": "cert.pem", "tls.key": "key.pem", "ca.crt": "ca.pem"}:
        problems.append(f"{where}: {own} must hold the Secret's tls.crt, tls.key, ca.crt as cert.pem, key.pem, ca.pem")
    certificate = certificates.get(secret.get("secretName"))
    expected = [f"spiffe://{DEFAULT_TRUST_DOMAIN}/service/{service}"]
    if certificate is None:
        problems.append(f"{where}: Secret {secret.get('secretName')!r} is no Certificate's secretName")
    elif certificate["spec"].get("uris") != expected:
        problems.append(f"{where}: Certificate {certificate['metadata']['name']} carries {certificate['spec'].get('uris')}, "
                        f"not {expected}")
    return problems


def _selects(service: dict, docs: list[dict], name: str) -> dict | None:
    """The container that ``service`` reaches, if its selector picks the pods serving ``name``."""
    selector = service["spec"].get("selector") or {}
    for doc in docs:
        labels = (doc["spec"]["template"]["metadata"].get("labels") or {}) if _pod(doc) else {}
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            for container in _containers(doc):
                if _served(container) == name:
                    return container
    return None


def _check_targets(where, env, services, docs) -> list[str]:
    targets = [("inference", entry) for entry in (env.get("AGW_GATEWAY_INFERENCE_TARGETS") or "").split(",") if entry]
    targets.append(("retrieval", env.get("AGW_GATEWAY_RETRIEVAL_TARGET") or ""))
    return _check_reached(where, targets, services, docs)


def _check_reached(where, targets: list[tuple[str, str]], services, docs, headless: bool = False) -> list[str]:
    """Each (service, host:port) names a Service of the manifests that selects that service's pods and forwards the
    port to the one it listens on; ``headless``: every target's Service must be headless."""
    problems = []
    for backend, target in targets:
        host, _, port = target.removeprefix("dns:///").rpartition(":")
        service = services.get(host.split(".")[0])
        container = _selects(service, docs, backend) if service else None
        if container is None:
            problems.append(f"{where}: {backend} target {target!r} names no Service selecting the {backend} pods")
            continue
        listening = int(_env(container)[f"AGW_{backend.upper()}_PORT"])
        if not any(p["port"] == int(port or 0) and p.get("targetPort") in (listening, *[
                cp.get("name") for cp in container["ports"] if cp["containerPort"] == listening])
                for p in service["spec"]["ports"]):
            problems.append(f"{where}: {backend} target {target!r}: the Service does not forward port {port} to "
                            f"{backend}'s {listening}")
        if (headless or backend == "inference" and target.startswith("dns:///")) and \
                service["spec"].get("clusterIP") != "None":
            problems.append(f"{where}: {target!r} needs a headless Service (clusterIP: None) to see every replica")
    return problems


def _check_edge(where, doc, container, services, docs, certificates) -> list[str]:
    """The edge runs its init container's bootstrap, holds its own identity alone, reaches each service through a
    headless Service, and is believed by all of ours."""
    problems = []
    pod = _pod(doc)
    config = option(container.get("args") or [], "-c")
    job = next((c for c in pod.get("initContainers", []) if (c.get("args") or [None])[0] == EDGE_CONFIG_COMMAND), None)
    if job is None:
        return [f"{where}: no init container runs '{EDGE_CONFIG_COMMAND}' to write its bootstrap"]
    args = [str(a) for a in job["args"]]
    out = option(args, "--out") or ""
    written = {m["name"]: m["mountPath"] for m in job.get("volumeMounts", [])}
    seen = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    shared = [name for name, path in written.items() if out.startswith(path.rstrip("/") + "/") and seen.get(name) == path]
    if config != out or not shared:
        problems.append(f"{where}: runs {config!r}, but {job['name']} writes {out!r}: mount its volume at the same path "
                        "(the bootstrap names its secret files by their paths there)")
    problems += _check_identity(where, doc, container, "edge", certificates, tls_dir=option(args, "--tls-dir"))
    problems += [f"{where}: listens on {port!r} ({flag}), not one of its container ports" for flag, port in
                 unexposed_listeners(args, {p["containerPort"] for p in container.get("ports", [])})]
    targets = [(name, target.strip()) for name in ("gateway", "inference", "retrieval")
               for target in (option(args, f"--{name}") or "").split(",")]
    problems += _check_reached(where, targets, services, docs, headless=True)
    problems += _check_edge_drain(where, pod, container, option(args, "--admin"))
    problems += _check_edge_heap(where, container, option(args, "--max-heap-mib"))
    problems += [problem for other in docs for ours in _containers(other) if _served(ours)
                 for problem in [unbelieved_edge(f"{other['kind']}/{other['metadata']['name']}/{ours['name']}",
                                                 _served(ours), _env(ours))] if problem]
    return problems


#: The most of the edge container's memory limit its heap bound may take: Envoy's RSS is its heap plus code, stacks
#: and what the allocator holds free, and the bound must trip before the kernel's OOM killer does.
EDGE_HEAP_SHARE = Fraction(4, 5)


def _check_edge_heap(where, container, max_heap_mib: str | None) -> list[str]:
    """Envoy's heap bound (``--max-heap-mib``, agentgw.edge) sits under the container's memory limit with room."""
    limit = _quantity(((container.get("resources") or {}).get("limits") or {}).get("memory"))
    heap = Fraction(int(max_heap_mib or DEFAULT_MAX_HEAP_MIB)) * 2**20
    if limit is not None and heap > EDGE_HEAP_SHARE * limit:
        return [f"{where}: --max-heap-mib {int(heap / 2**20)} is over {float(EDGE_HEAP_SHARE) * 100:.0f}% of the "
                f"container's memory limit ({container['resources']['limits']['memory']}): it would be OOM-killed "
                "with every stream before Envoy refused a call; keep the bound about three quarters of the limit"]
    return []


def _check_edge_drain(where, pod, container, admin: str | None) -> list[str]:
    """The preStop hook drains Envoy through its admin port, within the pod's termination grace."""
    script = " ".join(map(str, ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {})
                          .get("command", [])))
    return drain_problems(where, "its preStop", script, container.get("args") or [], admin,
                          pod.get("terminationGracePeriodSeconds", 30), "terminationGracePeriodSeconds")


def _pods_of(name: str) -> dict:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": name}}}


def _check_network(docs: list[dict]) -> list[str]:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    problems = []
    if not any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies):
        problems.append("NetworkPolicy: no default deny of ingress (podSelector {} and no ingress rule)")
    edge = any(c["image"].startswith(EDGE_IMAGE) for d in docs for c in _containers(d))
    callers = [_pods_of("agw-gateway"), *([_pods_of("agw-edge")] if edge else [])]
    doors = [("agw-inference", 50053, callers), ("agw-retrieval", 50052, callers),
             *([("agw-gateway", 50051, [_pods_of("agw-edge")])] if edge else [])]
    for target, port, allowed in doors:
        rules = [rule for p in policies if p["spec"]["podSelector"].get("matchLabels") == {
            "app.kubernetes.io/name": target} for rule in p["spec"].get("ingress", [])]
        admitting = [r for r in rules if any(p.get("port") == port for p in r.get("ports", []))]
        sources = [source for r in admitting for source in r.get("from", [None])]
        if not admitting or sorted(map(str, sources)) != sorted(map(str, allowed)):
            who = " and ".join(s["podSelector"]["matchLabels"]["app.kubernetes.io/name"].removeprefix("agw-")
                               for s in allowed)
            problems.append(f"NetworkPolicy: {target}'s port {port} must admit the {who}'s pods only (got {sources})")
    return problems


def main(argv: list[str] | None = None) -> int:
    directories = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or list(DEFAULT_DIRS)
    problems = [f"{directory}: {problem}" for directory in directories for problem in check(render(directory))]
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{', '.join(map(str, directories))}: valid (Kubernetes {KUBERNETES_VERSION} schemas) and consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
