#!/usr/bin/env python3
"""Routing across two inference replicas: cached prompt tokens, TTFT and load split, by policy; then a replica
killed mid-run and started again.

Starts retrieval, a private Postgres and two inference services (smoke model, 2 GiB of KV cache each), then,
for each policy, a gateway (one worker) and the same workload: sessions of three tenants (each tenant with its
own stable system prompt), in rounds; in each round every session sends one turn, in a shuffled order, at
``--concurrency`` turns at a time, so both replicas stay busy (two engines on this box that take turns request
by request stall, docs/benchmarks.md). A turn is an agent's: a user message carrying a tool's output of about
``--message-words`` words, and ``--max-tokens`` generated. Each policy's prompts start with a nonce of their own,
so no policy finds what an earlier one left in the caches.

Policies: ``single`` (one replica: the baseline the cache goal compares with), ``affinity``, ``round_robin``,
``least_loaded``; ``affinity@N`` (a load margin of N) and ``affinity-unplaced`` (new sessions' ids left to the
hash: AGW_GATEWAY_PLACE_SESSIONS=false) as variants. The gateways run with the prefix prefill off
(AGW_GATEWAY_PREFILL_PREFIX=false) unless ``--prefill``: a prefill computes a turn's new history on the replica
before the turn arrives, which the turn's usage then counts as cached although that replica's engine computed it, so
with it on the cached fraction no longer says what routing kept. Reported per policy: the fraction of prompt tokens served from the prefix cache (it does not
depend on this machine's timing, so it leads), TTFT p50/p95/p99 at the client, and the calls each replica got.

``edge-affinity`` and ``edge-least_request`` run the same sessions through the edge (Envoy as ``agentgw
edge-config --inference-routing affinity|least_request`` writes it) straight to the replicas' public
``Generate``, with no gateway: the client keeps each session's conversation and sends it whole each turn, as a
chat-completions client does. ``edge-affinity`` sends the session id in ``x-agw-affinity``. Their split is
counted from the replicas' own ``rpc.server.duration`` counts of the public Generate.

``--kill`` adds a phase with ``affinity``: after ``--kill-after`` rounds the second replica is killed (SIGKILL,
engine and all) while turns run, and started again on its port at once; the rounds go on. Reported: each failed
turn's status and whether it had received a token, turns per replica per round, and whether the killed
replica's sessions came back to it once it rejoined.

    python bench/replica_routing.py [--sessions 24] [--rounds 6] [--concurrency 8] [--kill] [--prefill] [--json FILE]
    python bench/replica_routing.py --policies affinity,least_loaded,edge-affinity,edge-least_request
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
from harness import (UNBOUNDED_ADMISSION, command_line, dev_pki, gateway_process, inference_process, print_table,
                     retrieval_process, scrape, scratch_dir, summary, write_json)

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from servicekit import ChannelSpec, ClientTls, open_channel, wait_ready
from servicekit.public_api import AFFINITY_HEADER
from tests.support.servers import free_port

TENANTS = ("acme", "globex", "initech")
WORDS = ("invoice shipment refund order ticket account latency region quota cluster deploy rollback metric alert "
         "owner budget contract renewal vendor schedule").split()


@dataclass
class Turn:
    ttft_ms: float | None = None
    status: str = "OK"
    got_token: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    session: str = ""


@dataclass
class Run:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    routed: dict[str, int] = field(default_factory=dict)
    spilled: int = 0  # calls the load bound moved off their session's first-ranked replica
    per_round: list[dict[str, int]] = field(default_factory=list)
    prefills: dict[str, int] = field(default_factory=dict)  # the replicas' prefix prefills, by outcome


def _system_prompt(nonce: str, tenant: str) -> str:
    rules = " ".join(f"Rule {i}: when the {WORDS[i % len(WORDS)]} is late, say so and cite its id." for i in range(12))
    return f"[{nonce}] You are the operations agent of {tenant}. {rules}"


def _message(rng: random.Random, round_: int, words: int) -> str:
    output = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Round {round_}. The tool returned: {output}. What next?"


def _channel(port: int, tls, identity: str) -> grpc.aio.Channel:
    return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls, identity)))


async def _turn(stub, session: str, system: str, message: str, max_tokens: int, on_token=None) -> Turn:
    turn, started = Turn(session=session), time.perf_counter()
    try:
        async for event in stub.Chat(pb.ChatRequest(
                session_id=session, message=message, system_prompt=system,
                generation=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)),
                timeout=120):
            if event.HasField("delta") and not turn.got_token:
                turn.got_token, turn.ttft_ms = True, (time.perf_counter() - started) * 1000
                if on_token is not None:
                    on_token()
            if event.HasField("final"):
                turn.prompt_tokens = event.final.usage.prompt_tokens
                turn.cached_tokens = event.final.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        turn.status = exc.code().name
    return turn


async def _routed(operator) -> dict[str, int]:
    stats = await operator.GetStats(pb.GetStatsRequest(), timeout=10)
    return {b.replica.name: b.replica.routed_affinity + b.replica.routed_spill + b.replica.routed_retry
            + b.replica.routed_balanced for b in stats.backends if b.name == "inference"}


async def _wait_routable(operator, count: int, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = await operator.GetStats(pb.GetStatsRequest(), timeout=10)
        if sum(b.replica.routable for b in stats.backends if b.name == "inference") >= count:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"fewer than {count} replicas routable after {within_s} s")


async def workload(port: int, tls, run: Run, args, *, between_rounds=None, on_token=None) -> None:
    """The rounds of turns through the gateway on ``port``; ``between_rounds(round, operator)`` runs before each
    round, ``on_token(round)`` at each turn's first token."""
    rng = random.Random(7)
    async with AsyncExitStack() as stack:
        stubs = {}
        for identity in [*(f"tenant/{t}" for t in TENANTS), "operator/admin"]:
            channel = await stack.enter_async_context(_channel(port, tls, identity))
            await wait_ready(channel, timeout_s=30, target=f"gateway as {identity}")
            stubs[identity] = gateway_pb2_grpc.AgentGatewayStub(channel)
        operator = stubs.pop("operator/admin")
        await _wait_routable(operator, 1 if run.policy == "single" else 2)
        sessions = []
        for index in range(args.sessions):
            tenant = TENANTS[index % len(TENANTS)]
            stub = stubs[f"tenant/{tenant}"]
            created = await stub.CreateSession(pb.CreateSessionRequest(), timeout=10)
            sessions.append((stub, created.session.id, _system_prompt(run.policy, tenant)))
        gate = asyncio.Semaphore(args.concurrency)

        async def one(stub, session, system, round_):
            async with gate:
                run.turns.append(await _turn(stub, session, system, _message(rng, round_, args.message_words),
                                             args.max_tokens, on_token and (lambda: on_token(round_))))

        for round_ in range(args.rounds):
            if between_rounds is not None:
                await between_rounds(round_, operator)
            before = await _routed(operator)
            order = sessions[:]
            rng.shuffle(order)
            await asyncio.gather(*(one(stub, session, system, round_) for stub, session, system in order))
            after = await _routed(operator)
            run.per_round.append({name: after[name] - before.get(name, 0) for name in after})
        run.routed = await _routed(operator)
        stats = await operator.GetStats(pb.GetStatsRequest(), timeout=10)
        run.spilled = sum(b.replica.routed_spill for b in stats.backends if b.name == "inference")


async def _generate_turn(stub, history: list, message: str, max_tokens: int, metadata) -> Turn:
    """One turn as a chat-completions client sends it through the edge: the whole conversation, each time."""
    history.append(inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=message))
    turn, started, text = Turn(), time.perf_counter(), []
    try:
        async for message_ in stub.Generate(pb.GenerateRequest(request=inference_pb2.GenerateRequest(
                chat=inference_pb2.ChatMessages(messages=history),
                sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))),
                metadata=metadata, timeout=120):
            response = message_.response
            if response.text and not turn.got_token:
                turn.got_token, turn.ttft_ms = True, (time.perf_counter() - started) * 1000
            text.append(response.text)
            if response.HasField("result"):
                turn.prompt_tokens = response.result.usage.prompt_tokens
                turn.cached_tokens = response.result.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        turn.status = exc.code().name
    history.append(inference_pb2.ChatMessage(role=inference_pb2.ROLE_ASSISTANT, content="".join(text)))
    return turn


async def edge_workload(port: int, stack: "Stack", run: Run, args) -> None:
    """The rounds of :func:`workload`, as Generate calls through the edge on ``port`` (``run.policy`` edge-*)."""
    rng = random.Random(7)
    async with AsyncExitStack() as exits:
        stubs = {}
        for tenant in TENANTS:
            channel = await exits.enter_async_context(_channel(port, stack.tls, f"tenant/{tenant}"))
            await wait_ready(channel, timeout_s=30, target=f"the edge as tenant/{tenant}")
            stubs[tenant] = gateway_pb2_grpc.AgentGatewayStub(channel)
        sessions = []
        for index in range(args.sessions):
            tenant = TENANTS[index % len(TENANTS)]
            session = f"{run.policy}-session-{index}"
            keyed = run.policy == "edge-affinity"
            sessions.append((stubs[tenant], session, [inference_pb2.ChatMessage(
                role=inference_pb2.ROLE_SYSTEM, content=_system_prompt(run.policy, tenant))],
                ((AFFINITY_HEADER, session),) if keyed else ()))
        gate = asyncio.Semaphore(args.concurrency)

        async def one(stub, session, history, metadata, round_):
            async with gate:
                turn = await _generate_turn(stub, history, _message(rng, round_, args.message_words),
                                            args.max_tokens, metadata)
                turn.session = session
                run.turns.append(turn)

        for round_ in range(args.rounds):
            before = stack.public_generates()
            order = sessions[:]
            rng.shuffle(order)
            await asyncio.gather(*(one(*session, round_) for session in order))
            after = stack.public_generates()
            run.per_round.append({name: after[name] - before.get(name, 0) for name in after})
        run.routed = {name: sum(r.get(name, 0) for r in run.per_round) for name in run.per_round[0]}


def _row(run: Run) -> dict:
    ok = [t for t in run.turns if t.status == "OK"]
    prompt = sum(t.prompt_tokens for t in ok)
    ttft = summary([t.ttft_ms for t in ok if t.ttft_ms is not None])
    total = sum(run.routed.values()) or 1
    return {"policy": run.policy, "turns": len(run.turns), "failed": len(run.turns) - len(ok),
            "prompt_tokens": prompt,
            "cached_fraction": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
            "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"], "ttft_p99_ms": ttft["p99"],
            "split": " / ".join(f"{name} {count / total:.0%}" for name, count in sorted(run.routed.items())),
            # The edge does not report its spills (Envoy counts none per key).
            "spilled": "-" if run.policy.startswith("edge-") else f"{run.spilled / total:.0%}",
            # Round 0 sends one turn per session: about how the sessions split (spills aside).
            "round_0": "/".join(str(count) for _, count in sorted(run.per_round[0].items())) if run.per_round else "",
            # What the replicas' prefix prefills did during the policy's run (none asked with the prefill off).
            "prefills": ", ".join(f"{outcome} {count}" for outcome, count in sorted(run.prefills.items()) if count)}


class Stack:
    """Retrieval, Postgres and the two inference replicas, started once; gateways come and go."""

    def __init__(self, root, tls, kv_cache_gib: float, prefill: bool = False) -> None:
        import pgserver

        self.root, self.tls, self.kv_cache_gib, self.prefill = root, tls, kv_cache_gib, prefill
        self.metrics_ports = [free_port(), free_port()]
        self.postgres = pgserver.get_server(root / "postgres", cleanup_mode="stop")
        self.started = []
        try:
            self.retrieval = self._start(retrieval_process(root, tls, "retrieval"))
            self.replicas = [self._start(self._replica(index)) for index in range(2)]
            self.ports = {"retrieval": self.retrieval.wait_serving(), "database_url": self.postgres.get_uri()}
            self.replica_ports = [replica.wait_serving() for replica in self.replicas]
        except BaseException:  # one failed to start: stop the others, or they outlive the bench and spin
            self.close()
            raise

    def _start(self, process):
        self.started.append(process)
        return process

    def _replica(self, index: int, port: int = 0):
        # Each also serves the public Generate to the edge (the edge-* policies), admitting what the bench sends.
        return inference_process(self.root, self.tls, f"inference-{index + 1}-{time.monotonic_ns()}",
                                 AGW_INFERENCE_KV_CACHE_GIB=str(self.kv_cache_gib),
                                 AGW_INFERENCE_EDGE_CLIENTS="service/edge", **UNBOUNDED_ADMISSION,
                                 AGW_INFERENCE_REPLICA_NAME=f"replica-{index + 1}",
                                 AGW_INFERENCE_METRICS_PORT=str(self.metrics_ports[index]),
                                 **({"AGW_INFERENCE_PORT": str(port)} if port else {}))

    def gateway(self, name: str, policy: str):
        """A gateway routing by ``policy``; ``affinity@N`` is affinity with a load margin of N,
        ``affinity-unplaced`` affinity with new sessions' ids left to chance (AGW_GATEWAY_PLACE_SESSIONS=false)."""
        targets = self.replica_ports[:1] if policy == "single" else self.replica_ports
        policy, _, margin = policy.partition("@")
        policy, unplaced = policy.removesuffix("-unplaced"), policy.endswith("-unplaced")
        process = self._start(gateway_process(self.root, self.tls, name, {**self.ports, "inference": 0}, **{
            "AGW_GATEWAY_INFERENCE_TARGET": "",
            "AGW_GATEWAY_INFERENCE_TARGETS": ",".join(f"127.0.0.1:{p}" for p in targets),
            "AGW_GATEWAY_INFERENCE_ROUTING": "affinity" if policy == "single" else policy,
            "AGW_GATEWAY_PLACE_SESSIONS": "false" if unplaced else "true",
            "AGW_GATEWAY_PREFILL_PREFIX": "true" if self.prefill else "false",
            **({"AGW_GATEWAY_ROUTING_LOAD_MARGIN": margin} if margin else {})}))
        return process, process.wait_serving()

    def edge(self, name: str, policy: str):
        """Envoy as ``agentgw edge-config`` writes it, in front of both replicas (``edge-least_request``: by load;
        else affine); returns (process, port) once a Generate goes through. Its other routes lead nowhere."""
        from agentgw.edge_process import EdgeProcess

        port = free_port()
        edge = EdgeProcess(self.root / name, self.tls, listen=f"127.0.0.1:{port}", gateway="127.0.0.1:9",
                           inference=[f"127.0.0.1:{p}" for p in self.replica_ports],
                           retrieval=f"127.0.0.1:{self.ports['retrieval']}",
                           inference_routing="least_request" if policy == "edge-least_request" else "affinity")
        return edge, port

    def public_generates(self) -> dict[str, int]:
        """Public Generate calls each replica has answered (its ``rpc.server.duration`` count)."""
        counts = {}
        for index, port in enumerate(self.metrics_ports):
            counts[f"replica-{index + 1}"] = int(sum(
                value for name, value in scrape(port).items()
                if name.startswith("rpc_server_duration") and "_count{" in name and "AgentGateway/Generate" in name))
        return counts

    def prefills(self) -> dict[str, int]:
        """Prefix prefills so far on both replicas, by outcome (``agw_inference_prefix_prefills_total``)."""
        counts: dict[str, int] = {}
        for port in self.metrics_ports:
            for name, value in scrape(port).items():
                if name.startswith("agw_inference_prefix_prefills_total{") and 'outcome="' in name:
                    outcome = name.split('outcome="', 1)[1].split('"', 1)[0]
                    counts[outcome] = counts.get(outcome, 0) + int(value)
        return counts

    def kill_and_restart(self, index: int):
        os.killpg(self.replicas[index].pid, signal.SIGKILL)
        self.replicas[index].process.wait()
        self.replicas[index] = self._start(self._replica(index, self.replica_ports[index]))

    def close(self) -> None:
        for process in reversed(self.started):
            process.stop()
        self.postgres.cleanup()


async def kill_phase(stack: Stack, args) -> tuple[Run, dict]:
    """affinity, with replica 2 killed (and restarted) while round ``--kill-after`` runs."""
    run = Run("affinity, replica 2 killed")
    gateway, port = stack.gateway("gateway-kill", "affinity")
    events = {}

    def kill(round_):
        """At the first token of round ``--kill-after``: turns of that round are streaming."""
        if round_ == args.kill_after and "killed_at_turn" not in events:
            events["killed_at_turn"] = len(run.turns)
            stack.kill_and_restart(1)

    async def between(round_, operator):
        if round_ == args.kill_after + 2:  # two rounds on the survivor, then wait for the rejoin
            started = time.perf_counter()
            await asyncio.to_thread(stack.replicas[1].wait_serving)
            await _wait_routable(operator, 2)
            events["rejoined_after_s"] = time.perf_counter() - started

    try:
        await workload(port, stack.tls, run, args, between_rounds=between, on_token=kill)
    finally:
        gateway.stop()
    return run, events


async def kv_tokens(stack: Stack) -> int:
    """Tokens a replica's KV cache holds (GetModelInfo), asked as an operator."""
    from agent.inference.v1 import inference_pb2_grpc

    async with _channel(stack.replica_ports[0], stack.tls, "operator/admin") as channel:
        info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest(),
                                                                            timeout=10)
    return info.kv_cache_tokens


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=6, help="turns per session")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--message-words", type=int, default=120, help="words of tool output in each user message")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--policies", default="single,affinity,round_robin,least_loaded",
                        help="comma-separated; affinity@N is affinity with AGW_GATEWAY_ROUTING_LOAD_MARGIN=N, "
                             "affinity-unplaced affinity with AGW_GATEWAY_PLACE_SESSIONS=false; edge-affinity "
                             "and edge-least_request go through the edge to the replicas' Generate")
    parser.add_argument("--kill", action="store_true", help="add the phase with a replica killed and restarted")
    parser.add_argument("--kill-after", type=int, default=2, help="the round during which the replica dies")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="each replica's KV cache; 2 holds every session many times over with the smoke model, "
                             "a small one makes the cache hold about one replica's share of the sessions")
    parser.add_argument("--prefill", action="store_true",
                        help="gateways with the prefix prefill on (AGW_GATEWAY_PREFILL_PREFIX): the cached fraction "
                             "then counts what prefills computed ahead as cached")
    parser.add_argument("--json", type=lambda p: __import__("pathlib").Path(p))
    args = parser.parse_args()
    root = scratch_dir("replicas")
    tls = dev_pki(root, tenants=TENANTS)
    stack = Stack(root, tls, args.kv_cache_gib, prefill=args.prefill)
    runs, kill = [], None
    try:
        kv = await kv_tokens(stack)
        for policy in args.policies.split(","):
            run = Run(policy)
            edge = policy.startswith("edge-")
            process, port = (stack.edge if edge else stack.gateway)(f"{'edge' if edge else 'gateway'}-{policy}", policy)
            before = stack.prefills()
            try:
                await (edge_workload(port, stack, run, args) if edge else workload(port, tls, run, args))
            finally:
                process.stop()
            run.prefills = {outcome: count - before.get(outcome, 0) for outcome, count in stack.prefills().items()}
            runs.append(run)
        if args.kill:
            kill = await kill_phase(stack, args)
    finally:
        stack.close()
    report(runs, kill, args, kv)


def report(runs: list[Run], kill, args, kv_tokens: int) -> None:
    rows = [_row(run) for run in runs]
    print(f"\n{command_line()}")
    # The working set: every session's last prompt, which holds all its earlier ones. Routing matters most where
    # it fits the two replicas' caches together but not one: affinity can keep it, round_robin makes each hold all.
    last: dict[str, int] = {}
    for turn in runs[0].turns if runs else ():
        last[turn.session] = max(last.get(turn.session, 0), turn.prompt_tokens)
    print_table(f"{args.sessions} sessions x {args.rounds} turns, 3 tenants, concurrency {args.concurrency}; "
                f"each replica's KV cache holds {kv_tokens} tokens; the sessions' last prompts add up to "
                f"{sum(last.values())} ({runs[0].policy if runs else ''}); prefix prefill "
                f"{'on' if args.prefill else 'off'}", rows,
                ["policy", "turns", "failed", "prompt_tokens", "cached_fraction", "ttft_p50_ms", "ttft_p95_ms",
                 "ttft_p99_ms", "split", "spilled", "round_0", "prefills"])
    by_policy = {row["policy"]: row for row in rows}
    if {"affinity", "single", "round_robin"} <= set(by_policy):
        affinity = by_policy["affinity"]["cached_fraction"]
        print(f"\naffinity cached fraction: {affinity / by_policy['single']['cached_fraction']:.2f}x single's "
              f"(goal >= 0.90), {affinity / max(by_policy['round_robin']['cached_fraction'], 1e-9):.2f}x "
              f"round_robin's (goal >= 1.5)")
        # With the workload inside one replica's cache, keeping every session on one replica (single) is the
        # best any router can do: round_robin then loses only what a session added since it last visited a replica.
        print(f"single / round_robin: {by_policy['single']['cached_fraction'] / max(by_policy['round_robin']['cached_fraction'], 1e-9):.2f}x "
              "(the ceiling of affinity / round_robin when every session fits one replica's cache)")
    if {"edge-affinity", "edge-least_request"} <= set(by_policy):
        keyed, spread = by_policy["edge-affinity"]["cached_fraction"], by_policy["edge-least_request"]["cached_fraction"]
        print(f"\nthe edge: affinity (x-agw-affinity) cached fraction {keyed / max(spread, 1e-9):.2f}x least_request's")
    data = {"runs": rows, "kv_cache_tokens": kv_tokens, "working_set_tokens": sum(last.values()),
            "prefix_prefill": args.prefill}
    if kill is not None:
        run, events = kill
        failed = [t for t in run.turns if t.status != "OK"]
        print(f"\n{run.policy}: {len(run.turns)} turns, {len(failed)} failed: "
              f"{sorted({t.status for t in failed})}; failed before any token: "
              f"{sum(not t.got_token for t in failed)}; rejoined {events.get('rejoined_after_s', 0):.1f} s after "
              "the wait began")
        print_table("turns per replica, by round", [{"round": i, **r} for i, r in enumerate(run.per_round)],
                    ["round", *sorted({k for r in run.per_round for k in r})])
        data["kill"] = {"row": _row(run), "per_round": run.per_round, "events": events,
                        "failed": [t.__dict__ for t in failed]}
    write_json(args.json, data)


if __name__ == "__main__":
    asyncio.run(main())
