"""compose/docker-compose.yml, checked statically (no Docker engine runs here) against the code."""

from __future__ import annotations

import copy

import pytest

from agentgw import composecheck

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def compose() -> dict:
    return composecheck.load()


def test_the_shipped_file_holds(compose):
    assert composecheck.check(compose) == []
    assert set(compose["services"]) >= {"certs", "postgres", "qdrant", "jaeger", "retrieval", "inference", "gateway"}
    inference = compose["services"]["inference"]
    assert inference["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert inference["environment"]["AGW_MODEL"].startswith("${AGW_MODEL")
    assert compose["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def _broken(compose: dict, change) -> list[str]:
    copy_ = copy.deepcopy(compose)
    change(copy_["services"])
    return composecheck.check(copy_)


@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: s["qdrant"].pop("healthcheck"), "qdrant: no healthcheck"),
    (lambda s: s["retrieval"].update(expose=["50099", "9465"]), "retrieval: listens on 50052"),
    (lambda s: s["gateway"]["environment"].update(AGW_GATEWAY_INFERENCE_TARGET="inference:50099"),
     "AGW_GATEWAY_INFERENCE_TARGET uses port 50099 but inference listens on 50053"),
    (lambda s: s["gateway"]["environment"].update(AGW_GATEWAY_RETRIEVAL_TARGET="search:50052"),
     "names host 'search', not a service"),
    (lambda s: s["retrieval"]["environment"].update(AGW_RETRIEVAL_EMBED_MODLE="x"),
     "AGW_RETRIEVAL_EMBED_MODLE is not a setting of the retrieval service"),
    (lambda s: s["postgres"].update(image="postgres:latest"), "postgres: image 'postgres:latest' is not pinned"),
    (lambda s: s["gateway"]["environment"].update(AGW_TLS_DIR="/certs"), "different AGW_TLS_DIR paths"),
    (lambda s: s["gateway"]["depends_on"].update(postgres={"condition": "service_started"}),
     "depends_on postgres without condition service_healthy"),
    # Keys: no service sees the CA's key or another service's key.
    (lambda s: s["retrieval"]["volumes"].append("tls:/tls:ro"), "retrieval: mounts the whole certificate volume"),
    (lambda s: s["inference"]["volumes"].append({"type": "volume", "source": "tls", "target": "/tls/service/gateway",
                                                 "read_only": True, "volume": {"subpath": "service/gateway"}}),
     "inference: mounts another identity's folder (service/gateway)"),
    (lambda s: s["gateway"]["volumes"].append({"type": "volume", "source": "tls", "target": "/tls/ca-key.pem",
                                               "read_only": True, "volume": {"subpath": "ca-key.pem"}}),
     "gateway: mounts the CA key"),
    (lambda s: s["gateway"]["volumes"].append("./tls/ca-key.pem:/run/ca-key.pem:ro"), "gateway: mounts the CA key"),
    (lambda s: s["gateway"]["volumes"][0].update(read_only=False), "gateway: its identity folder is mounted read-write"),
    # Safe defaults: nothing but the gateway published, stores internal, real secrets.
    (lambda s: s["jaeger"].update(ports=["16686:16686"]), "jaeger: publishes port 16686 on every host interface"),
    (lambda s: s["jaeger"].update(ports=[{"target": 16686, "published": 16686}]),
     "jaeger: publishes port 16686 on every host interface"),
    (lambda s: s["postgres"].update(networks=["internal", "edge"]), "postgres: a data store on network(s) ['edge']"),
    (lambda s: s["qdrant"].pop("networks"), "qdrant: a data store on network(s) ['default']"),
    (lambda s: s["qdrant"].pop("entrypoint"), "qdrant: Qdrant runs without an API key"),
    (lambda s: s["retrieval"]["environment"].pop("AGW_QDRANT_API_KEY_FILE"),
     "AGW_QDRANT_URL without AGW_QDRANT_API_KEY_FILE"),
    (lambda s: s["postgres"]["environment"].update(POSTGRES_PASSWORD="${POSTGRES_PASSWORD:-change-me}"),
     "postgres: POSTGRES_PASSWORD accepts the placeholder password"),
    (lambda s: s["postgres"]["environment"].update(POSTGRES_PASSWORD="${POSTGRES_PASSWORD}"),
     "use POSTGRES_PASSWORD_FILE with a secret"),
    (lambda s: s["gateway"]["environment"].update(AGW_DATABASE_URL="postgresql://agentgw:pw@postgres:5432/agentgw"),
     "gateway: AGW_DATABASE_URL carries a password"),
])
def test_a_broken_copy_fails_naming_the_problem(compose, change, expected):
    problems = _broken(compose, change)
    assert any(expected in problem for problem in problems), problems


def test_the_shipped_file_follows_the_compose_spec():
    import subprocess
    import sys
    from pathlib import Path

    checker = Path(sys.executable).with_name("check-jsonschema")
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(composecheck.DEFAULT_FILE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_command_line_exits_1_on_a_broken_file(compose, tmp_path, capsys):
    import yaml

    broken = copy.deepcopy(compose)
    del broken["services"]["gateway"]["healthcheck"]
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert composecheck.main([str(path)]) == 1
    assert "gateway: no healthcheck" in capsys.readouterr().out
    assert composecheck.main([]) == 0


# The edge: compose/edge.yml over the base file, as `docker compose -f BASE -f EDGE` merges them.

@pytest.fixture(scope="module")
def with_edge() -> dict:
    return composecheck.load(composecheck.DEFAULT_FILE, composecheck.EDGE_FILE)


def test_the_edge_override_holds_and_takes_the_public_port(with_edge):
    assert composecheck.check(with_edge) == []
    services = with_edge["services"]
    assert services["edge"]["ports"] == ["50051:50051"]
    assert "ports" not in services["gateway"] and services["gateway"]["networks"] == ["internal"]
    for name in ("gateway", "inference", "retrieval"):
        assert services[name]["environment"][f"AGW_{name.upper()}_EDGE_CLIENTS"] == "service/edge"
    # The override only adds: the base's environment is still there.
    assert services["gateway"]["environment"]["AGW_GATEWAY_RETRIEVAL_TARGET"] == "retrieval:50052"


def _job(services: dict) -> list:
    return services["edge-config"]["command"]


def _set_option(command: list, flag: str, value: str) -> None:
    command[command.index(flag) + 1] = value


def _drop_option(command: list, flag: str) -> None:
    del command[command.index(flag):command.index(flag) + 2]


@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: s["inference"]["environment"].pop("AGW_INFERENCE_EDGE_CLIENTS"),
     "inference: AGW_INFERENCE_EDGE_CLIENTS does not name service/edge: it would refuse what the edge forwards "
     "(Generate and Retrieve: UNIMPLEMENTED)"),
    (lambda s: s["gateway"]["environment"].update(AGW_GATEWAY_EDGE_CLIENTS="service/proxy"),
     "gateway: AGW_GATEWAY_EDGE_CLIENTS does not name service/edge"),
    (lambda s: s["gateway"].update(ports=["50052:50051"]),
     "gateway: publishes port 50052 on every host interface; only the edge's public port may be"),
    (lambda s: s["edge"]["volumes"].append("tls:/tls:ro"), "edge: mounts the whole certificate volume"),
    (lambda s: s["edge"]["volumes"][0]["volume"].update(subpath="service/gateway"),
     "edge: mounts another identity's folder (service/gateway)"),
    (lambda s: _set_option(_job(s), "--inference", "inference:50099"),
     "edge: --inference 'inference:50099' uses port 50099 but inference listens on 50053"),
    (lambda s: _set_option(_job(s), "--retrieval", "search:50052"),
     "edge: --retrieval 'search:50052' names no retrieval service"),
    (lambda s: _set_option(_job(s), "--gateway", "retrieval:50052"),
     "edge: --gateway 'retrieval:50052' names no gateway service"),
    (lambda s: _set_option(_job(s), "--listen", "0.0.0.0:8443"), "edge: listens on '8443' (--listen)"),
    (lambda s: _set_option(_job(s), "--metrics", "0.0.0.0:9999"), "edge: listens on '9999' (--metrics)"),
    (lambda s: _set_option(_job(s), "--tls-dir", "/certs"), "its bootstrap reads certificates under /certs"),
    (lambda s: _set_option(s["edge"]["command"], "-c", "/data/other.json"),
     "edge: runs '/data/other.json', which no 'edge-config --out' job writes"),
    (lambda s: s["edge"]["volumes"][1].update(target="/edge"), "at the job's own path"),
    (lambda s: s["edge"]["depends_on"].pop("edge-config"), "edge: does not wait for edge-config"),
    (lambda s: s["edge"].update(image="envoyproxy/envoy:latest"), "edge: image 'envoyproxy/envoy:latest' is not pinned"),
    # A stop drains Envoy first: through the admin port, waiting out the drain, within the stop's grace.
    (lambda s: _drop_option(_job(s), "--admin"), "edge: no --admin for edge-config: nothing can drain Envoy"),
    (lambda s: s["edge"].pop("entrypoint"),
     "edge: its entrypoint does not POST /drain_listeners?graceful to the admin port 127.0.0.1:9901"),
    (lambda s: _set_option(s["edge"]["command"], "--drain-time-s", "30"),
     "edge: its entrypoint waits 20 s after the drain starts, less than --drain-time-s 30"),
    (lambda s: s["edge"].pop("stop_grace_period"), "edge: stop_grace_period 10 < its entrypoint's 20 s"),
])
def test_a_broken_edge_fails_naming_the_problem(with_edge, change, expected):
    problems = _broken(with_edge, change)
    assert any(expected in problem for problem in problems), problems


def test_the_merge_follows_compose(tmp_path):
    (tmp_path / "base.yml").write_text(
        "services:\n  a:\n    image: x:1\n    ports: ['1:1']\n    networks: [one, two]\n    expose: ['9']\n"
        "    environment: {A: '1', B: '2'}\n")
    (tmp_path / "over.yml").write_text(
        "services:\n  a:\n    ports: !reset []\n    networks: !override [three]\n    expose: ['8']\n"
        "    environment: {B: '3', C: '4'}\n  b:\n    image: y:2\n    networks: !override [four]\n")
    merged = composecheck.load(tmp_path / "base.yml", tmp_path / "over.yml")
    assert merged["services"]["a"] == {"image": "x:1", "networks": ["three"], "expose": ["9", "8"],
                                       "environment": {"A": "1", "B": "3", "C": "4"}}
    assert merged["services"]["b"] == {"image": "y:2", "networks": ["four"]}


def test_the_edge_layout_follows_the_compose_spec(with_edge, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    merged = tmp_path / "merged.yml"
    merged.write_text(yaml.safe_dump(with_edge))
    checker = Path(sys.executable).with_name("check-jsonschema")
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(merged)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_edge_jobs_bootstrap_is_one_envoy_accepts(with_edge, pki, tmp_path):
    """The job's own arguments, with the test PKI for /tls and a folder here for /data."""
    from tests.support.edge import assert_edge_config_loads

    assert_edge_config_loads(with_edge["services"]["edge-config"]["command"], pki.root, tmp_path)


def test_the_command_line_checks_the_files_merged(capsys):
    assert composecheck.main([str(composecheck.DEFAULT_FILE), str(composecheck.EDGE_FILE)]) == 0
    assert "ok (9 services)" in capsys.readouterr().out
