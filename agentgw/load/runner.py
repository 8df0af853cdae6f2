"""Sending the schedule: open loop (each turn at its scheduled time, however fast answers come) or closed loop.

Open loop measures from the *scheduled* send time, so a gateway that falls
behind shows its queueing instead of slowing the load down (no coordinated
omission); the runner also records how late it itself was to send each turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from agentgw.load.workload import TurnSpec, message_text

#: A send later than this after its scheduled time counts as the runner falling behind.
LATE_SEND_S = 0.010


@dataclass
class TurnResult:
    """One turn as the client saw it; times in ms from the scheduled send (open loop) or the send (closed)."""

    spec: TurnSpec
    scheduled_s: float
    send_lag_ms: float
    status: str = "OK"
    #: A failed turn's status message, as the gateway sent it.
    detail: str = ""
    first_token_ms: float | None = None
    total_ms: float | None = None
    stages: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"spec": self.spec.to_json(), "scheduled_s": self.scheduled_s, "send_lag_ms": self.send_lag_ms,
                "status": self.status, "detail": self.detail, "first_token_ms": self.first_token_ms,
                "total_ms": self.total_ms, "stages": self.stages}


@dataclass
class Target:
    """Stubs per tenant, and each tenant's sessions, created on first use."""

    stubs: dict[str, gateway_pb2_grpc.AgentGatewayStub]
    collection: str = "docs"
    timeout_s: float = 60.0
    sessions: dict[tuple[str, int], str] = field(default_factory=dict)

    async def session_id(self, tenant: str, index: int | None) -> str:
        if index is None:
            return ""
        key = (tenant, index)
        if key not in self.sessions:
            created = await self.stubs[tenant].CreateSession(pb.CreateSessionRequest(), timeout=self.timeout_s)
            self.sessions.setdefault(key, created.session.id)
        return self.sessions[key]

    def request(self, spec: TurnSpec, session_id: str, seed: int) -> pb.ChatRequest:
        # A stable system prompt per tenant: its prefix is cached, as an agent platform's is.
        return pb.ChatRequest(
            session_id=session_id, message=message_text(spec.message_chars, seed),
            system_prompt=f"You are {spec.tenant}'s agent. Answer briefly.",
            generation=inference_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True),
            retrieval=pb.RetrievalOptions(collection=self.collection, top_k=3) if spec.retrieval else None)


async def run_turn(target: Target, spec: TurnSpec, seed: int, scheduled: float, lag_ms: float,
                   clock: Callable[[], float]) -> TurnResult:
    """Send one turn; every outcome is a result (a failure is its status code), never an exception."""
    result = TurnResult(spec, spec.at_s, lag_ms)
    try:
        request = target.request(spec, await target.session_id(spec.tenant, spec.session), seed)
        async for event in target.stubs[spec.tenant].Chat(request, timeout=target.timeout_s):
            kind = event.WhichOneof("event")
            if kind in ("delta", "tool_call") and result.first_token_ms is None:
                result.first_token_ms = (clock() - scheduled) * 1000
            elif kind == "final":
                timings = event.final.timings
                result.stages = {name: getattr(timings, f"{name}_ms") for name in
                                 ("admission", "history", "retrieval", "first_token", "generation", "persist", "total")}
        result.total_ms = (clock() - scheduled) * 1000
    except grpc.aio.AioRpcError as error:
        result.status = error.code().name
        result.detail = error.details() or ""
        result.total_ms = (clock() - scheduled) * 1000
    return result


async def open_loop(target: Target, turns: list[TurnSpec], on_result: Callable[[TurnResult], None]) -> list[TurnResult]:
    """Each turn at its scheduled time; latency counted from that time."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tasks = []
    for index, spec in enumerate(turns):
        scheduled = start + spec.at_s
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag_ms = max(0.0, (loop.time() - scheduled) * 1000)
        task = asyncio.ensure_future(run_turn(target, spec, index, scheduled, lag_ms, loop.time))
        task.add_done_callback(lambda t: on_result(t.result()) if not t.cancelled() else None)
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def closed_loop(target: Target, turns: list[TurnSpec], concurrency: int, think_s: float,
                      on_result: Callable[[TurnResult], None]) -> list[TurnResult]:
    """``concurrency`` workers, each sending its next turn when the last is answered (plus think time)."""
    loop = asyncio.get_running_loop()
    queue = iter(enumerate(turns))
    results: list[TurnResult] = []
    start = loop.time()

    async def worker():
        for index, spec in queue:
            sent = loop.time()
            result = await run_turn(target, spec, index, sent, 0.0, loop.time)
            result.scheduled_s = sent - start
            results.append(result)
            on_result(result)
            if think_s:
                await asyncio.sleep(think_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def late_sends(results: list[TurnResult]) -> tuple[int, float]:
    """How many turns the runner itself sent late (over LATE_SEND_S), and the worst lag in ms."""
    lags = [r.send_lag_ms for r in results]
    return sum(lag > LATE_SEND_S * 1000 for lag in lags), max(lags, default=0.0)
