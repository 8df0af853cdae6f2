"""The channel factory's options and service config."""

from __future__ import annotations

import json

import grpc
import pytest

from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit import ChannelSpec, KeepalivePolicy, RetryPolicy, service_config
from servicekit.channels import status_after_failed_write
from tests.support.ended_call import EndedCall

pytestmark = pytest.mark.unit

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
RETRIEVAL = retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"]
DENIED = (grpc.StatusCode.PERMISSION_DENIED, "tenant/dev may not call /x.Y/Z")


def test_retry_policy_covers_exactly_the_idempotent_unary_methods():
    config = json.loads(service_config([INFERENCE, RETRIEVAL]))
    names = {(n["service"], n["method"]) for n in config["methodConfig"][0]["name"]}
    assert names == {
        ("agent.inference.v1.Inference", "Tokenize"),
        ("agent.inference.v1.Inference", "GetModelInfo"),
        ("agent.inference.v1.Inference", "GetLoad"),
        ("agent.retrieval.v1.Retrieval", "GetCollection"),
        ("agent.retrieval.v1.Retrieval", "DeleteCollection"),
        ("agent.retrieval.v1.Retrieval", "Upsert"),
        ("agent.retrieval.v1.Retrieval", "Delete"),
        ("agent.retrieval.v1.Retrieval", "Search"),
    }
    assert ("agent.inference.v1.Inference", "Generate") not in names
    policy = config["methodConfig"][0]["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]


def test_no_retry_policy_when_disabled():
    config = json.loads(service_config([INFERENCE], retry=None))
    assert "methodConfig" not in config and "retryThrottling" not in config


def test_channel_owns_its_connection_and_bounds_messages():
    options = dict(ChannelSpec(target="x:1", tls=None, max_message_bytes=1 << 20).options())
    assert options["grpc.use_local_subchannel_pool"] == 1
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.max_send_message_length"] == 1 << 20


def test_a_pinned_stream_window_turns_grpcs_probes_off_and_an_unpinned_one_leaves_them():
    pinned = dict(ChannelSpec(target="x:1", tls=None, stream_window_bytes=256 * 1024).options())
    assert pinned["grpc.http2.bdp_probe"] == 0  # else the probes overwrite the window at their next round trip
    assert pinned["grpc.http2.lookahead_bytes"] == 256 * 1024
    unpinned = dict(ChannelSpec(target="x:1", tls=None).options())
    assert "grpc.http2.bdp_probe" not in unpinned and "grpc.http2.lookahead_bytes" not in unpinned


@pytest.mark.parametrize("time_s", [1.0, 7.5, 20.0, 300.0])
def test_server_accepts_the_pings_the_client_sends(time_s):
    policy = KeepalivePolicy(time_s=time_s, timeout_s=1.0)
    client = dict(policy.client_options())
    server = dict(policy.server_options())
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


def test_retry_backoff_renders_as_durations():
    config = json.loads(service_config([INFERENCE], retry=RetryPolicy(initial_backoff_s=0.1, max_backoff_s=2)))
    assert config["methodConfig"][0]["retryPolicy"]["initialBackoff"] == "0.1s"
    assert config["methodConfig"][0]["retryPolicy"]["maxBackoff"] == "2s"


async def test_a_failed_write_reports_the_peers_status_once_it_replaces_the_placeholder():
    error = await status_after_failed_write(EndedCall(*DENIED, placeholder_reads=3), poll_s=0)
    assert (error.code(), error.details()) == DENIED


async def test_a_placeholder_that_never_clears_is_returned_after_the_bounded_wait():
    error = await status_after_failed_write(EndedCall(*DENIED, placeholder_reads=None), settle_s=0.05,
                                            poll_s=0.01)
    assert (error.code(), error.details()) == (grpc.StatusCode.INTERNAL, "Internal error from Core")
