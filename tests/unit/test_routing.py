"""The replica ranking (gateway.routing) and the rules around it (gateway.replicas): stable in every process,
minimal movement when a replica leaves, the load bound, and the refusals when no replica can take a call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import grpc
import pytest

from agent.inference.v1 import inference_pb2
from gateway.replicas import Replica, Replicas
from gateway.routing import Placement, Policy, Reason, Router, generate_key, prefix_key, rank, session_key
from servicekit.errors import ResourceExhausted, Unavailable

NAMES = [f"inference-{i}" for i in range(5)]
KEYS = [session_key("tenant-salt", f"session-{i}") for i in range(2000)]


def _router(policy=Policy.AFFINITY, loads=None, margin=4, with_room=()):
    """A router over names; every replica is full (a new call would queue) except those ``with_room``."""
    loads = loads or {}
    return Router(policy, name=lambda r: r, load=lambda r: loads.get(r, 0), margin=margin,
                  full=lambda r: r not in with_room)


def test_the_ranking_is_the_same_in_another_process_with_another_hash_seed():
    mine = [rank(key, NAMES) for key in KEYS[:200]]
    script = ("import json, sys; from gateway.routing import rank, session_key; "
              "print(json.dumps([rank(session_key('tenant-salt', f'session-{i}'), sys.argv[1:]) for i in range(200)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    theirs = json.loads(subprocess.run([sys.executable, "-c", script, *NAMES], env=env, check=True,
                                       capture_output=True, text=True).stdout)
    assert mine == theirs


def test_keys_spread_over_every_replica():
    router = _router()
    firsts = [router.choose(key, NAMES).replica for key in KEYS]
    shares = {name: firsts.count(name) / len(KEYS) for name in NAMES}
    assert all(0.12 < share < 0.28 for share in shares.values()), shares  # 0.2 each, give or take


def test_a_leaving_replica_moves_only_its_own_keys_to_their_next_choice_and_they_return():
    router = _router()
    before = {key: router.choose(key, NAMES) for key in KEYS}
    survivors = [name for name in NAMES if name != "inference-2"]
    after = {key: router.choose(key, survivors) for key in KEYS}
    moved = [key for key in KEYS if after[key].replica != before[key].replica]
    assert moved and all(before[key].replica == "inference-2" for key in moved)
    assert all(after[key].replica == NAMES[rank(key, NAMES)[1]] for key in moved)  # its next-ranked
    returned = {key: router.choose(key, NAMES).replica for key in KEYS}
    assert returned == {key: choice.replica for key, choice in before.items()}


def test_within_the_margin_the_first_ranked_replica_keeps_the_key():
    key = KEYS[0]
    first, second, *_ = [NAMES[i] for i in rank(key, NAMES)]
    choice = _router(loads={first: 4}, margin=4).choose(key, NAMES)
    assert (choice.replica, choice.reason) == (first, Reason.AFFINITY)


def test_past_the_margin_the_key_spills_to_its_next_ranked_replica_within_the_bound():
    key = KEYS[0]
    first, second, third, fourth, _ = [NAMES[i] for i in rank(key, NAMES)]
    loads = {name: 2 for name in NAMES} | {first: 7, second: 7}  # least 2, bound 6: the third-ranked
    router = _router(loads=loads, margin=4)
    choice = router.choose(key, NAMES)
    assert (choice.replica, choice.reason) == (third, Reason.SPILL)
    # A retry (without the replica that failed) still follows the key's ranking: the next within the bound.
    assert router.choose(key, [n for n in NAMES if n != third]).replica == fourth


def test_a_replica_with_room_in_its_batch_keeps_the_key_however_loaded():
    key = KEYS[0]
    first, second, third, *_ = [NAMES[i] for i in rank(key, NAMES)]
    loads = {name: 0 for name in NAMES} | {first: 40, second: 30}  # both far past the bound (4)
    choice = _router(loads=loads, with_room={first}).choose(key, NAMES)
    assert (choice.replica, choice.reason) == (first, Reason.AFFINITY)
    # A full first replica spills to the next in the ranking with room, even past the bound.
    choice = _router(loads=loads, with_room={second}).choose(key, NAMES)
    assert (choice.replica, choice.reason) == (second, Reason.SPILL)
    choice = _router(loads=loads).choose(key, NAMES)  # none with room: the next within the bound
    assert (choice.replica, choice.reason) == (third, Reason.SPILL)


def test_a_replica_is_full_when_calls_wait_or_its_batch_limit_is_reached_counting_calls_since_the_report():
    replica = _replica("r")
    assert replica.full  # its batch limit not reported (an older replica): only the margin decides
    replica.max_running, replica.running = 4, 3
    assert not replica.full
    replica.pool.channels[0].stats.in_flight = 1  # this worker's call since the report takes the last slot
    assert replica.full
    replica.pool.channels[0].stats.in_flight, replica.waiting = 0, 1
    assert replica.full


def test_least_loaded_and_round_robin_ignore_the_key():
    loads = {name: 5 for name in NAMES} | {"inference-3": 1}
    choice = _router(Policy.LEAST_LOADED, loads=loads).choose(KEYS[0], NAMES)
    assert (choice.replica, choice.reason) == ("inference-3", Reason.BALANCED)
    router = _router(Policy.ROUND_ROBIN)
    assert [router.choose(KEYS[0], NAMES).replica for _ in range(6)] == [*NAMES, NAMES[0]]


def test_prefix_keys_use_the_leading_text_only_and_keep_tenants_apart():
    long_system = "s" * 3000
    assert prefix_key("a", [long_system, "hello"], 2048) == prefix_key("a", [long_system, "bye"], 2048)
    assert prefix_key("a", ["sys", "hello"], 2048) != prefix_key("a", ["sys", "bye"], 2048)
    assert prefix_key("a", ["sys"], 2048) != prefix_key("b", ["sys"], 2048)
    chat = inference_pb2.GenerateRequest(cache_salt="a", chat=inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role=inference_pb2.ROLE_SYSTEM, content="sys"),
        inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content="hello")]))
    assert generate_key(chat, 2048) == prefix_key("a", ["sys", "hello"], 2048)


def _first(session_id: str, names) -> str:
    return names[rank(session_key("tenant-salt", session_id), names)[0]]


def test_new_sessions_are_placed_evenly_and_routing_still_needs_no_state():
    placement, names = Placement(), NAMES[:2]
    key_of = lambda session_id: session_key("tenant-salt", session_id)  # noqa: E731
    ids = [placement.session_id(key_of, names) for _ in range(24)]
    firsts = [_first(i, names) for i in ids]
    # A hash alone splits 24 sessions 8/16 or worse about one time in seven; placement splits them 12/12.
    assert {name: firsts.count(name) for name in names} == {name: 12 for name in names}
    # A session's replica is still its key's first in the ranking: any process, with no counts, agrees.
    assert all(_router().choose(key_of(i), names).replica == first for i, first in zip(ids, firsts))
    assert len(set(ids)) == len(ids) and all(str(uuid.UUID(i)) == i for i in ids)  # plain UUIDs


def test_a_replica_new_to_placement_starts_level_with_the_least_placed():
    placement = Placement()
    key_of = lambda session_id: session_key("tenant-salt", session_id)  # noqa: E731
    for _ in range(20):
        placement.session_id(key_of, NAMES[:2])
    firsts = [_first(placement.session_id(key_of, NAMES[:3]), NAMES[:3]) for _ in range(30)]
    # The joiner takes its third of the new sessions, not all of them until it has placed 10.
    assert {name: firsts.count(name) for name in NAMES[:3]} == {name: 10 for name in NAMES[:3]}


def test_placement_needs_two_replicas_and_only_affinity_places():
    placement = Placement()
    assert uuid.UUID(placement.session_id(lambda i: i.encode(), NAMES[:1])) and not placement.placed
    replicas = _replicas(_replica("a"), _replica("b"))
    replicas.router.policy = Policy.ROUND_ROBIN
    replicas.new_session_id(lambda i: session_key("s", i))
    assert not replicas.placement.placed
    replicas.router.policy = Policy.AFFINITY
    replicas.new_session_id(lambda i: session_key("s", i))
    assert sum(replicas.placement.placed.values()) == 1
    unplaced = _replicas(_replica("a"), _replica("b"), place_sessions=False)  # AGW_GATEWAY_PLACE_SESSIONS=false
    assert uuid.UUID(unplaced.new_session_id(lambda i: session_key("s", i))) and unplaced.placement is None


def _replica(name: str, *, serving=True, load_known=True, waiting=0) -> Replica:
    pool = SimpleNamespace(serving=serving, channels=[SimpleNamespace(stalled=False, stats=SimpleNamespace(in_flight=0))])
    replica = Replica(name, pool, None)
    replica.load_known, replica.waiting = load_known, waiting
    return replica


def _replicas(*replicas: Replica, max_waiting=0, place_sessions=True) -> Replicas:
    router = Router(Policy.AFFINITY, name=lambda r: r.key, load=lambda r: r.load, margin=4)
    found = Replicas([r.address for r in replicas], open_pool=None, router=router, tls=None,
                     max_waiting=max_waiting, resolve_s=10, server_name=None, place_sessions=place_sessions)
    found.replicas = {r.address: r for r in replicas}
    return found


def test_a_replica_not_serving_or_with_unknown_load_is_not_chosen():
    up = _replica("up")
    replicas = _replicas(_replica("down", serving=False), _replica("unknown", load_known=False), up)
    assert {replicas.choose(key).replica for key in KEYS[:50]} == {up}


def test_no_routable_replica_is_unavailable_naming_them():
    replicas = _replicas(_replica("a", serving=False), _replica("b", load_known=False))
    with pytest.raises(Unavailable, match="no inference replica is serving") as caught:
        replicas.choose(KEYS[0])
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "a serving=False" in caught.value.internal and "b serving=True load_known=False" in caught.value.internal


def test_max_waiting_keeps_calls_off_a_full_replica_and_refuses_when_all_are():
    full, free = _replica("full", waiting=3), _replica("free", waiting=1)
    assert {_replicas(full, free, max_waiting=3).choose(key).replica for key in KEYS[:50]} == {free}
    with pytest.raises(ResourceExhausted, match="AGW_GATEWAY_MAX_INFERENCE_WAITING=3"):
        _replicas(full, _replica("full-too", waiting=5), max_waiting=3).choose(KEYS[0])


def test_the_doctor_reports_each_replicas_hit_rate_and_warns_on_a_skewed_split():
    from agent.gateway.v1 import gateway_pb2 as pb
    from agentgw.doctor import Status, replica_checks

    even = [pb.ReplicaStats(name="a", routable=True, routed_affinity=20, prompt_tokens=1000, cached_prompt_tokens=900),
            pb.ReplicaStats(name="b", routable=True, routed_affinity=18, routed_spill=2, prompt_tokens=800)]
    checks = replica_checks(even, "affinity")
    assert [c.status for c in checks] == [Status.PASS] * 3
    assert "prefix cache 90% of 1000 prompt tokens" in checks[0].measured
    assert "a 20 / b 20 calls (2 spilled" in checks[2].measured
    skewed = [pb.ReplicaStats(name="a", routable=True, routed_affinity=40),
              pb.ReplicaStats(name="b", routable=False, routed_affinity=2)]
    checks = replica_checks(skewed, "affinity")
    assert checks[1].status == Status.WARN and "NOT routable" in checks[1].measured
    assert checks[2].status == Status.WARN and "1.9x the even share" in checks[2].fix


def test_the_replica_settings_are_checked_at_start():
    from gateway.settings import GatewaySettings

    assert GatewaySettings().inference_target_list == ["127.0.0.1:50053"]
    assert GatewaySettings(inference_targets="a:1, dns:///b.svc:2").inference_target_list == ["a:1", "dns:///b.svc:2"]
    for bad, message in (({"inference_target": "a:1", "inference_targets": "b:1"}, "not both"),
                         ({"inference_targets": "a:1,a:1"}, "lists a replica twice"),
                         ({"inference_targets": "dns:///b.svc"}, "is not host:port or dns:///name:port"),
                         ({"inference_targets": "a:99999"}, "is not host:port"),
                         ({"inference_routing": "random"}, "inference_routing")):
        with pytest.raises(ValueError, match=message):
            GatewaySettings(**bad)
