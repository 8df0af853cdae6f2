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
  volume, which holds the CA's key, nor another identity's folder and key.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from servicekit.settings import environment_names

#: ``agentgw serve NAME`` -> the service's settings class, by import path.
SETTINGS = {
    "gateway": "gateway.settings:GatewaySettings",
    "retrieval": "retrieval.settings:RetrievalSettings",
    "inference": "inference.settings:InferenceSettings",
}
#: Variables our code reads outside the Settings classes: none.
EXTRA_VARIABLES: set[str] = set()
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"


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


def _check_exposure(compose: dict, served: dict) -> list[str]:
    problems = []
    services = compose.get("services") or {}
    internal = {name for name, spec in (compose.get("networks") or {}).items() if (spec or {}).get("internal")}
    for name, spec in services.items():
        for mapping in spec.get("ports", []):
            host, port = _published(mapping)
            if served[name] != "gateway" and host not in ("127.0.0.1", "::1", "localhost"):
                problems.append(f"{name}: publishes port {port} on every host interface; only the gateway's public "
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


def load(path: Path = DEFAULT_FILE) -> dict:
    return yaml.safe_load(Path(path).read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else DEFAULT_FILE
    problems = check(load(path))
    for problem in problems:
        print(f"{path}: {problem}")
    if not problems:
        print(f"{path}: ok ({len(load(path)['services'])} services)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
