"""Static checks of ``compose/docker-compose.yml`` against the code, for machines without Docker.

``python -m agentgw.composecheck [FILE]`` prints one line per problem and
exits 1 if there are any. What it holds the file to:
- every service has a health check, and every image a pinned version;
- ``depends_on`` waits on health (or on a one-shot's successful exit);
- every ``AGW_*`` variable given to one of our services is a setting of that
  service (so a renamed setting cannot leave a silently ignored variable);
- each service listens on the port the file exposes, and every
  ``*_TARGET``/URL names a service of the file on the port it listens on;
- nothing is published beyond the host's loopback but the gateway's public
  port; the data stores (Postgres, Qdrant) sit on internal networks only;
- Qdrant runs with an API key that retrieval presents, and no password is a
  placeholder or sits in the file: Postgres reads ``POSTGRES_PASSWORD_FILE``
  and the gateway ``AGW_DATABASE_PASSWORD_FILE``, both from secrets;
- all our services read certificates from one ``AGW_TLS_DIR``, and each mounts,
  read-only, only its own identity's folder (``service/<name>``, as a
  ``subpath`` of the volume the certificate job writes): never the whole
  volume, which holds the CA's key, nor another identity's folder and key;
- with an edge (``compose/edge.yml``: Envoy, running the bootstrap that an
  ``agentgw edge-config`` job writes), the edge is the one published port: it
  runs that job's file, mounts only ``service/edge``, the job's targets name
  our services on their ports, and every service of ours believes the edge
  (``AGW_<SERVICE>_EDGE_CLIENTS``), or the backends would not serve it
  ``Generate`` and ``Retrieve``.

``python -m agentgw.composecheck BASE OVERRIDE`` checks the files merged as
``docker compose -f BASE -f OVERRIDE`` merges them (maps merge, sequences
append, ``!reset`` and ``!override`` as the Compose specification says).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from servicekit.settings import environment_names

from agentgw.edge import EDGE

#: ``agentgw serve NAME`` -> the service's settings class, by import path.
SETTINGS = {
    "gateway": "gateway.settings:GatewaySettings",
    "retrieval": "retrieval.settings:RetrievalSettings",
    "inference": "inference.settings:InferenceSettings",
}
#: Variables our code reads outside the Settings classes: none.
EXTRA_VARIABLES: set[str] = set()
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
#: The override that puts the edge in front: docker compose -f DEFAULT_FILE -f EDGE_FILE.
EDGE_FILE = DEFAULT_FILE.with_name("edge.yml")
#: An edge is a service of this image, running the bootstrap a job of this command writes.
EDGE_IMAGE = "envoyproxy/envoy"
EDGE_CONFIG_COMMAND = "edge-config"
EDGE_IDENTITY = str(EDGE)


def _settings_class(service: str):
    module, name = SETTINGS[service].split(":")
    return getattr(__import__(module, fromlist=[name]), name)


def _environment(spec: dict) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _container_ports(spec: dict) -> set[int]:
    ports = {int(str(p).split("/")[0]) for p in spec.get("expose", [])}
    for mapping in spec.get("ports", []):
        target = mapping.get("target") if isinstance(mapping, dict) else str(mapping).split(":")[-1]
        ports.add(int(str(target).split("/")[0]))
    return ports


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    subpath: str = ""
    read_only: bool = False


def _mount_list(spec: dict) -> list[Mount]:
    mounts = []
    for volume in spec.get("volumes", []):
        if isinstance(volume, dict):
            mounts.append(Mount(str(volume.get("source", "")), str(volume["target"]),
                                str((volume.get("volume") or {}).get("subpath", "")).strip("/"),
                                bool(volume.get("read_only", False))))
        else:
            parts = str(volume).split(":")
            mounts.append(Mount(parts[0], parts[1], "", len(parts) > 2 and "ro" in parts[2].split(",")))
    return mounts


def _mounts(spec: dict) -> dict[str, str]:
    """Container path -> volume (or host path)."""
    return {mount.target: mount.source for mount in _mount_list(spec)}


def _served(spec: dict) -> str | None:
    command = spec.get("command") or []
    if isinstance(command, str):
        command = command.split()
    if len(command) >= 2 and command[0] == "serve" and command[1] in SETTINGS:
        return command[1]
    return None


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest") and any(c.isdigit() for c in tag)


def check(compose: dict) -> list[str]:
    """Every problem found in a parsed compose file; an empty list means it holds."""
    problems: list[str] = []
    services: dict[str, dict] = compose.get("services") or {}
    listening: dict[str, int] = {}  # service -> the port its settings make it listen on
    served = {name: _served(spec) for name, spec in services.items()}

    for name, spec in services.items():
        if not (spec.get("healthcheck") or {}).get("test"):
            problems.append(f"{name}: no healthcheck")
        image = spec.get("image")
        if not image:
            problems.append(f"{name}: no image (name and pin the image, even when it is built)")
        elif not _pinned(image):
            problems.append(f"{name}: image {image!r} is not pinned to a version")
        depends = spec.get("depends_on") or {}
        if isinstance(depends, list):
            problems.append(f"{name}: depends_on must say condition: service_healthy (got a plain list)")
            depends = {}
        for dependency, condition in depends.items():
            if dependency not in services:
                problems.append(f"{name}: depends on unknown service {dependency!r}")
            elif (condition or {}).get("condition") not in ("service_healthy", "service_completed_successfully"):
                problems.append(f"{name}: depends_on {dependency} without condition service_healthy")

        service = served[name]
        if service is None:
            continue
        env = _environment(spec)
        known = set(environment_names(_settings_class(service))) | EXTRA_VARIABLES
        for variable in sorted(v for v in env if v.startswith("AGW_") and v not in known):
            problems.append(f"{name}: {variable} is not a setting of the {service} service")
        port_variable = f"AGW_{service.upper()}_PORT"
        if port_variable not in env:
            problems.append(f"{name}: {port_variable} not set (the port must be explicit)")
        else:
            listening[name] = int(env[port_variable])
            if listening[name] not in _container_ports(spec):
                problems.append(f"{name}: listens on {listening[name]} ({port_variable}) but exposes "
                                f"{sorted(_container_ports(spec))}")
        metrics = env.get(f"AGW_{service.upper()}_METRICS_PORT")
        if metrics and int(metrics) not in _container_ports(spec):
            problems.append(f"{name}: metrics port {metrics} is not exposed")

    problems += _check_targets(services, served, listening)
    problems += _check_certificates(services, served)
    problems += _check_exposure(compose, served)
    problems += _check_secrets(services, served)
    problems += _check_edges(services, served, listening)
    return problems


#: Images of the data stores, which must sit on internal networks only.
DATA_STORES = ("postgres", "qdrant/qdrant")
PLACEHOLDERS = ("change-me", "changeme")


def _published(mapping) -> tuple[str, str]:
    """(host address, what) of a ``ports`` entry; an empty address means every interface."""
    if isinstance(mapping, dict):
        return str(mapping.get("host_ip", "")), str(mapping.get("published", mapping.get("target")))
    parts = str(mapping).split(":")
    return (parts[0] if len(parts) == 3 else ""), parts[-2] if len(parts) > 1 else parts[0]


def _edges(services: dict) -> list[str]:
    return [name for name, spec in services.items() if str(spec.get("image", "")).startswith(EDGE_IMAGE)]


def _check_exposure(compose: dict, served: dict) -> list[str]:
    problems = []
    services = compose.get("services") or {}
    internal = {name for name, spec in (compose.get("networks") or {}).items() if (spec or {}).get("internal")}
    # The public door: the edge where there is one (the gateway sits behind it), else the gateway.
    edges = _edges(services)
    door = "the edge" if edges else "the gateway"
    for name, spec in services.items():
        for mapping in spec.get("ports", []):
            host, port = _published(mapping)
            public = name in edges if edges else served[name] == "gateway"
            if not public and host not in ("127.0.0.1", "::1", "localhost"):
                problems.append(f"{name}: publishes port {port} on every host interface; only {door}'s public "
                                "port may be, bind others to 127.0.0.1")
        image = str(spec.get("image", ""))
        if image.startswith(DATA_STORES):
            networks = spec.get("networks") or ["default"]
            outside = sorted(set(networks) - internal)
            if outside:
                problems.append(f"{name}: a data store on network(s) {outside}, which are not internal: true")
    return problems


def _check_secrets(services: dict, served: dict) -> list[str]:
    problems = []
    for name, spec in services.items():
        env = _environment(spec)
        for variable, value in env.items():
            if any(placeholder in value.lower() for placeholder in PLACEHOLDERS):
                problems.append(f"{name}: {variable} accepts the placeholder password ({value!r})")
        if "POSTGRES_PASSWORD" in env:
            problems.append(f"{name}: POSTGRES_PASSWORD in the file's environment; use POSTGRES_PASSWORD_FILE "
                            "with a secret")
        url = env.get("AGW_DATABASE_URL", "")
        if url and urlsplit(re.sub(r"\$\{[^}]*\}", "x", url)).password is not None:
            problems.append(f"{name}: AGW_DATABASE_URL carries a password; use AGW_DATABASE_PASSWORD_FILE with a secret")
        if str(spec.get("image", "")).startswith("qdrant/qdrant"):
            where = " ".join(map(str, [*env, *(spec.get("entrypoint") or []), *(spec.get("command") or [])]))
            if "QDRANT__SERVICE__API_KEY" not in where:
                problems.append(f"{name}: Qdrant runs without an API key (QDRANT__SERVICE__API_KEY from a secret)")
        if served[name] == "retrieval" and env.get("AGW_QDRANT_URL") and not (
                env.get("AGW_QDRANT_API_KEY_FILE") or env.get("AGW_QDRANT_API_KEY")):
            problems.append(f"{name}: AGW_QDRANT_URL without AGW_QDRANT_API_KEY_FILE: Qdrant would take anyone")
    return problems


def _check_targets(services: dict, served: dict, listening: dict) -> list[str]:
    problems = []
    for name, spec in services.items():
        if served[name] is None:
            continue
        for variable, value in _environment(spec).items():
            if not variable.startswith("AGW_"):
                continue
            if variable.endswith("_TARGET"):
                host, _, port = value.rpartition(":")
            elif variable.endswith("_URL") and "://" in value:
                parts = urlsplit(re.sub(r"\$\{[^}]*\}", "x", value))  # ${PASSWORD:?...} interpolations
                host, port = parts.hostname or "", str(parts.port or "")
            else:
                continue
            if host not in services:
                problems.append(f"{name}: {variable} names host {host!r}, not a service of this file")
            elif host in listening and port and int(port) != listening[host]:
                problems.append(f"{name}: {variable} uses port {port} but {host} listens on {listening[host]}")
    return problems


def _check_certificates(services: dict, served: dict) -> list[str]:
    problems = []
    ours = {name: spec for name, spec in services.items() if served[name]}
    paths = {name: _environment(spec).get("AGW_TLS_DIR") for name, spec in ours.items()}
    if len(set(paths.values())) > 1:
        problems.append(f"services read certificates from different AGW_TLS_DIR paths: {paths}")
    writers = {name: spec for name, spec in services.items()
               if "certs" in (spec.get("command") or []) and "--dir" in spec.get("command")}
    if not writers:
        problems.append("no service runs 'agentgw certs --dir ...' to create the certificates")
        return problems
    for writer, spec in writers.items():
        command = spec["command"]
        path = command[command.index("--dir") + 1]
        volume = _mounts(spec).get(path)
        for name, tls_dir in paths.items():
            if tls_dir != path:
                problems.append(f"{name}: AGW_TLS_DIR={tls_dir} but {writer} writes certificates to {path}")
            else:
                identity = _environment(ours[name]).get(f"AGW_{served[name].upper()}_IDENTITY", served[name])
                problems += _check_identity_mount(name, ours[name], volume, tls_dir, f"service/{identity}")
            if writer not in (ours[name].get("depends_on") or {}):
                problems.append(f"{name}: does not wait for {writer} (depends_on)")
    return problems


def _check_identity_mount(name: str, spec: dict, volume: str | None, tls_dir: str, own: str) -> list[str]:
    """A service sees its own identity folder, read-only, and no other key: not the CA's, not another's."""
    problems = []
    mounts = [mount for mount in _mount_list(spec) if mount.source == volume]
    for mount in mounts:
        if not mount.subpath:
            problems.append(f"{name}: mounts the whole certificate volume {volume!r} at {mount.target}, with the CA "
                            f"key (ca-key.pem) and every identity's key; mount only subpath {own}")
        elif mount.subpath != own:
            what = "the CA key" if "ca-key" in mount.subpath else f"another identity's folder ({mount.subpath})"
            problems.append(f"{name}: mounts {what} from volume {volume!r}; a service gets only {own}")
        elif mount.target.rstrip("/") != f"{tls_dir.rstrip('/')}/{own}":
            problems.append(f"{name}: its identity folder is mounted at {mount.target}, but it reads "
                            f"{tls_dir.rstrip('/')}/{own} (AGW_TLS_DIR)")
        elif not mount.read_only:
            problems.append(f"{name}: its identity folder is mounted read-write; mount it read_only")
    for mount in _mount_list(spec):  # host files: a key by its name
        if mount.source != volume and ("ca-key" in mount.source or "ca-key" in mount.subpath):
            problems.append(f"{name}: mounts the CA key ({mount.source}); only the certificate job may see it")
    if not any(mount.subpath == own for mount in mounts):
        problems.append(f"{name}: does not mount its identity folder {own} from volume {volume!r}")
    return problems


def option(command: list, flag: str) -> str | None:
    """The value after ``flag`` in a command's arguments, if it is there."""
    return str(command[command.index(flag) + 1]) if flag in command and command.index(flag) + 1 < len(command) else None


def _check_edges(services: dict, served: dict, listening: dict) -> list[str]:
    """An edge runs the bootstrap its job writes, holds only its own key, reaches our services on their ports, and
    is believed by each of them."""
    problems = []
    jobs = {name: spec for name, spec in services.items() if (spec.get("command") or [None])[0] == EDGE_CONFIG_COMMAND}
    for edge in _edges(services):
        spec = services[edge]
        config = option(list(spec.get("command") or []), "-c")
        job = next((name for name in jobs if _edge_config_path(jobs[name], spec) == config), None)
        if config is None or job is None:
            problems.append(f"{edge}: runs {config!r}, which no '{EDGE_CONFIG_COMMAND} --out' job writes into a "
                            "volume it mounts at the job's own path")
            continue
        command = [str(part) for part in jobs[job]["command"]]
        if (spec.get("depends_on") or {}).get(job, {}).get("condition") != "service_completed_successfully":
            problems.append(f"{edge}: does not wait for {job} (depends_on, condition service_completed_successfully)")
        problems += _check_edge_identity(edge, spec, services, command)
        problems += _check_edge_routes(edge, spec, command, served, listening)
        problems += drain_problems(edge, "its entrypoint", " ".join(map(str, spec.get("entrypoint") or [])),
                                   [str(a) for a in spec.get("command") or []], option(command, "--admin"),
                                   _duration_s(spec.get("stop_grace_period")), "stop_grace_period")
        problems += [problem for name, service in served.items() if service
                     for problem in [unbelieved_edge(name, service, _environment(services[name]))] if problem]
    return problems


def unbelieved_edge(where: str, service: str, env: dict) -> str | None:
    """The problem, if ``service`` (its environment ``env``) does not believe the edge: it refuses what the edge
    forwards, and a backend answers the edge's Generate or Retrieve UNIMPLEMENTED."""
    variable = f"AGW_{service.upper()}_EDGE_CLIENTS"
    if EDGE_IDENTITY in [entry.strip() for entry in (env.get(variable) or "").split(",")]:
        return None
    return (f"{where}: {variable} does not name {EDGE_IDENTITY}: it would refuse what the edge forwards"
            + (" (Generate and Retrieve: UNIMPLEMENTED)" if service != "gateway" else ""))


def drain_problems(where: str, hook: str, script: str, envoy_args: list, admin: str | None, grace_s: float,
                   grace_name: str) -> list[str]:
    """Envoy exits on SIGTERM at once, cutting every call through it: ``script`` (what runs before SIGTERM reaches
    Envoy, named ``hook``) must POST /drain_listeners?graceful to its admin port and wait at least the drain time,
    and the stop's grace (``grace_name``) must cover it."""
    if not admin:
        return [f"{where}: no --admin for {EDGE_CONFIG_COMMAND}: nothing can drain Envoy before SIGTERM cuts the "
                "calls in flight"]
    host, _, port = admin.rpartition(":")
    drain_at = script.find("drain_listeners?graceful")
    if drain_at < 0 or f"/dev/tcp/{host}/{port}" not in script:
        return [f"{where}: {hook} does not POST /drain_listeners?graceful to the admin port {admin}"]
    drain_s = int(option(envoy_args, "--drain-time-s") or 600)  # Envoy's default
    waited = sum(int(n) for n in re.findall(r"\bsleep (\d+)", script[drain_at:]))
    total = sum(int(n) for n in re.findall(r"\bsleep (\d+)", script))
    problems = []
    if waited < drain_s:
        problems.append(f"{where}: {hook} waits {waited} s after the drain starts, less than --drain-time-s "
                        f"{drain_s}: SIGTERM would cut the calls the drain lets finish")
    if grace_s < total:
        problems.append(f"{where}: {grace_name} {grace_s:g} < {hook}'s {total} s")
    return problems


def _duration_s(text) -> float:
    """A Compose duration ("30s", "1m30s", "1.5s"); Compose's default for stop_grace_period is 10 s."""
    if text is None:
        return 10.0
    parts = re.findall(r"([\d.]+)(h|ms|m|s|us)", str(text))
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(value) * scale[unit] for value, unit in parts)


def _edge_config_path(job: dict, edge: dict) -> str | None:
    """The bootstrap ``job`` writes, if ``edge`` mounts the volume it is written into at the same path: the bootstrap
    names its secret files by their paths as the job wrote them."""
    out = option(list(job.get("command") or []), "--out")
    for written in _mount_list(job):
        if out and out.startswith(written.target.rstrip("/") + "/"):
            for seen in _mount_list(edge):
                if (seen.source, seen.target.rstrip("/"), seen.subpath) == (written.source, written.target.rstrip("/"), ""):
                    return out
    return None


def _check_edge_identity(edge: str, spec: dict, services: dict, command: list[str]) -> list[str]:
    tls_dir = option(command, "--tls-dir") or ""
    writers = [s for s in services.values() if "certs" in (s.get("command") or []) and "--dir" in s["command"]]
    for writer in writers:
        path = option(writer["command"], "--dir")
        if path != tls_dir:
            return [f"{edge}: its bootstrap reads certificates under {tls_dir} (--tls-dir) but the certificates are "
                    f"written to {path}"]
        return _check_identity_mount(edge, spec, _mounts(writer).get(path), tls_dir, EDGE_IDENTITY)
    return []


def unexposed_listeners(arguments: list, exposed: set[int]) -> list[tuple[str, str]]:
    """(flag, port) of each listener an ``edge-config`` command gives the edge (``--listen``, and ``--metrics`` if
    set) whose port is not among ``exposed``."""
    missing = []
    for flag in ("--listen", "--metrics"):
        value = option(arguments, flag)
        port = (value or "").rpartition(":")[2]
        if (value or flag == "--listen") and (not port.isdigit() or int(port) not in exposed):
            missing.append((flag, port))
    return missing


def _check_edge_routes(edge: str, spec: dict, command: list[str], served: dict, listening: dict) -> list[str]:
    exposed = _container_ports(spec)
    problems = [f"{edge}: listens on {port!r} ({flag}) but exposes {sorted(exposed)}"
                for flag, port in unexposed_listeners(command, exposed)]
    for flag, service in (("--gateway", "gateway"), ("--inference", "inference"), ("--retrieval", "retrieval")):
        for target in (option(command, flag) or "").split(","):
            host, _, port = target.strip().rpartition(":")
            if served.get(host) != service:
                problems.append(f"{edge}: {flag} {target!r} names no {service} service of this file")
            elif host in listening and int(port or 0) != listening[host]:
                problems.append(f"{edge}: {flag} {target!r} uses port {port} but {host} listens on {listening[host]}")
    return problems


class _Reset:
    """``!reset``: the key is gone from the merged file."""


class _Override:
    """``!override VALUE``: VALUE replaces the base's instead of merging with it."""

    def __init__(self, value) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    """YAML with the Compose specification's merge tags."""


def _construct(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
_ComposeLoader.add_constructor("!override", lambda loader, node: _Override(_construct(loader, node)))


def _merged(base, override):
    """``override`` over ``base``, as ``docker compose -f BASE -f OVERRIDE`` merges them."""
    if isinstance(override, _Override):
        return _plain(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if isinstance(value, _Reset):
                merged.pop(key, None)
            else:
                merged[key] = _merged(base[key], value) if key in base else _plain(value)
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return [*base, *(item for item in _plain(override) if item not in base)]
    return _plain(override)


def _plain(value):
    """A value with its merge tags applied to nothing (a file read on its own)."""
    if isinstance(value, _Override):
        return _plain(value.value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if not isinstance(item, _Reset)}
    if isinstance(value, list):
        return [_plain(item) for item in value if not isinstance(item, _Reset)]
    return value


def load(*paths: Path) -> dict:
    """The compose files merged in order (the base file alone by default)."""
    merged: dict = {}
    for path in paths or (DEFAULT_FILE,):
        merged = _merged(merged, yaml.load(Path(path).read_text(), Loader=_ComposeLoader) or {})
    return merged


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in argv] or [DEFAULT_FILE]
    compose = load(*paths)
    where = " + ".join(map(str, paths))
    problems = check(compose)
    for problem in problems:
        print(f"{where}: {problem}")
    if not problems:
        print(f"{where}: ok ({len(compose['services'])} services)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
