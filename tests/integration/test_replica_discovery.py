"""Replicas found through DNS (``dns:///name:port``): one replica per address, verified as the name, ranked by
the name each replica reports; re-resolved, so a replica that leaves DNS leaves routing and one that comes back
rejoins with its keys.

The first test resolves ``localhost`` with the machine's own resolver. The second needs several addresses for one
name, which this machine's resolver cannot be made to give: it hands the gateway a resolver whose answers the
test sets, in front of real servers on 127.0.0.2 and 127.0.0.3 (both loopback on Linux) sharing one port.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from gateway.backends import _replicas
from gateway.routing import session_key
from gateway.settings import GatewaySettings
from servicekit.tls import ClientTls
from tests.support.gateway_stack import gateway_server, gateway_stub
from tests.support.retrieval_service import retrieval_server
from tests.support.servers import scripted_app


async def _until(condition, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.05)


async def test_a_dns_entry_becomes_a_replica_per_address_verified_as_the_name(tmp_path, pki, database_url):
    async with scripted_app(pki.root, replica_name="replica-a") as (running, scripted), \
            retrieval_server(tmp_path / "retrieval", pki.root) as (retrieval, _), \
            gateway_server(pki.root, f"dns:///localhost:{running.port}", retrieval.port,
                           database_url=database_url) as (gateway, app), \
            gateway_stub(gateway.port, pki.root) as stub:
        replicas = app.servicer.backends.inference.replicas
        assert set(replicas) <= {f"127.0.0.1:{running.port}", f"[::1]:{running.port}"} and replicas
        replica = next(iter(replicas.values()))
        assert replica.pool.spec.tls.server_name == "localhost"  # the dialled address is an IP; the name is not
        await _until(lambda: replica.key == "replica-a", 5, "the replica's reported name")
        responses = [r async for r in stub.Generate(pb.GenerateRequest(
            request=inference_pb2.GenerateRequest(prompt="tokens=2")), timeout=10)]
        assert [r.response.text for r in responses[:-1]] == ["t0 ", "t1 "]
        assert scripted.servicer.generations == 1


@pytest.mark.parametrize("resolver_fails", [False, True])
async def test_re_resolution_removes_a_replica_that_left_and_brings_it_back_with_its_keys(pki, resolver_fails):
    async with scripted_app(pki.root, host="127.0.0.2", replica_name="replica-2") as (two, _):
        async with scripted_app(pki.root, host="127.0.0.3", port=two.port, replica_name="replica-3") as (three, _):
            answers = {"addresses": ["127.0.0.2", "127.0.0.3"], "fail": False}

            async def resolve(host: str, port: int) -> list[str]:
                assert (host, port) == ("agw-inference.test", two.port)
                if answers["fail"]:
                    raise OSError("resolver down")
                return list(answers["addresses"])

            settings = GatewaySettings(tls_dir=pki.root, inference_targets=f"dns:///agw-inference.test:{two.port}",
                                       inference_resolve_s=0.1, backend_server_name="localhost")
            replicas = _replicas(settings, ClientTls.for_identity(pki.root, "service/gateway"), resolve=resolve)
            await replicas.start()
            try:
                await _until(lambda: len(replicas.replicas) == 2 and all(
                    r.routable and r.key.startswith("replica-") for r in replicas.replicas.values()), 5,
                    "both replicas routable under their names")
                key = next(k for k in (session_key("salt", str(i)) for i in range(64))
                           if replicas.choose(k).replica.key == "replica-3")
                if resolver_fails:  # an outage of the resolver keeps the replicas it last gave
                    answers["fail"] = True
                    await asyncio.sleep(0.5)
                    assert len(replicas.replicas) == 2
                    answers["fail"] = False
                leaving = replicas.replicas[f"127.0.0.3:{two.port}"]
                with leaving.pool.use() as pooled:  # a call in flight on it when it leaves DNS (a draining pod)
                    call = pooled.stub(inference_pb2_grpc.InferenceStub).Generate(
                        inference_pb2.GenerateRequest(prompt="tokens=10 delay=0.05"), timeout=10)
                    answers["addresses"] = ["127.0.0.2"]
                    await _until(lambda: list(replicas.replicas) == [f"127.0.0.2:{two.port}"], 5, "replica-3 leaving")
                    assert replicas.choose(key).replica.key == "replica-2"  # its keys moved to their next choice
                    assert len([m async for m in call]) == 11  # and the call on it was left to finish
                await _until(lambda: leaving.pool.channels[0].state == grpc.ChannelConnectivity.SHUTDOWN, 5,
                             "the leaving replica's pool closed once its call was done")
                answers["addresses"] = ["127.0.0.2", "127.0.0.3"]
                await _until(lambda: any(r.key == "replica-3" and r.routable for r in replicas.replicas.values()), 5,
                             "replica-3 rejoining")
                assert replicas.choose(key).replica.key == "replica-3"  # and came back
            finally:
                await replicas.close()
