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
