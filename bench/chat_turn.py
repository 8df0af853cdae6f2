#!/usr/bin/env python3
"""A whole agent turn through the gateway, against the inference service called directly.

Starts the stack (inference, retrieval on Qdrant Edge, the gateway with
Postgres), ingests a sample corpus, then runs Chat turns (session history plus
retrieval plus `--max-tokens` generated, 16 by default; each session asks its
questions in an order of its own, ``session_questions``) and, interleaved, the very prompt the
gateway builds for that turn (same history, same retrieved context) sent
straight to the inference service, in a prefix-cache partition of its own (a
cache salt) so that neither path reuses the other's prompt: each finds cached
only what its own earlier turns left, as a real client would. Reports time to
first token and total, p50/p95/p99, at concurrency 1 and 8, and the gateway's
share of the first token: gateway TTFT - (max(history, retrieval) + direct
TTFT), from the p50s (the goal's form), in its sum form (the median of each
turn's stages plus its direct first token, ``share_forms``: the p50 form
also charges the gateway the skew of a median of sums), and paired turn by
turn, with its p99; and the turns the gateway refused with RESOURCE_EXHAUSTED (admission
shedding load), which are left out of the latency figures. Next to the edge
(what the client sees outside the gateway's own clock) it reports the
client's own event-loop lag, since the client shares the host's cores. Levels 1, 8, 32
and 64 by default; the gateway runs with its default admission bounds
(AGW_GATEWAY_MAX_IN_FLIGHT 64 per worker, half of it per tenant).

The bench builds the direct prompts without load that no real client adds
(until 2026-12-05 it listed the session's messages and searched again, through
the gateway, before every turn: one more call on the gateway and Postgres, and
one more query on retrieval, where Chat's own stage waited behind it). Their
retrieved context is searched once per question before the levels run (the
collection does not change during a run); their history is kept here from what
each Chat turn streamed, as the gateway stores it. Both are checked: each Chat
turn's own context (its ``context`` event), and each session's stored messages
once its level is done; the report counts the turns and sessions that differ.
Every turn's own figures go into the JSON (``turns``, ``TurnSample``), so any
form of the share can be recomputed from a run.

``--side-by-side early`` adds a second gateway with
AGW_GATEWAY_OPEN_GENERATE_EARLY off (a plain Generate call once the prompt is
ready); ``--side-by-side prefill``, one with AGW_GATEWAY_PREFILL_PREFIX off
(the history sent ahead is tokenized, not prefilled). It is called as another
tenant so its prompts have their own prefix-cache partition; each turn then
runs on all three paths, in rotating order, and the report compares the two
gateways on the same turns.

``--backend-nice 5`` runs inference and retrieval at nice 5
(``AGW_<SERVICE>_NICE``), and the bench's own process too once the stack is up
(so that the load generator, which a real deployment runs elsewhere, competes
for CPU as the backends do): only the gateway and Postgres keep nice 0.

``--isolate-engine gateway,inference,...`` leaves the CPUs vLLM's CPU worker
bound its threads to (one of 2 cores) to that worker alone against the
process groups named (gateway, inference, retrieval, postgres, client):
once the stack is up, their threads move to the other CPUs, and what they
start later inherits that. ``inference`` is the service's own process and
vLLM's engine core (the scheduler), the worker's bound threads left where
they are. On 2 cores it took the engine's part out of the share, and gave
no turn an earlier first token (docs/benchmarks.md, "The engine worker's
core to itself").

``--export-traces all|RATIO`` has every service of ours export its traces
(all, or that ratio of them, OpenTelemetry's ``parentbased_traceidratio``)
to a sink that counts them and keeps nothing (bench/trace_sink.py), as a
deployment with a collector does. Off by default: the goals are judged
without it, and ``bench/tracing_overhead.py`` measures what it adds.

    python bench/chat_turn.py [--turns 50] [--max-tokens 16] [--window-step 16] [--side-by-side early|prefill] [--no-retrieval] [--backend-nice 5] [--isolate-engine GROUPS] [--export-traces all|RATIO] [--json bench/out/chat.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

import grpc
import statistics
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from harness import (UNBOUNDED_ADMISSION, CpuMeter, backend_processes, command_line, dev_pki, engine_worker_cpus,
                     export_environment, export_ratio, exporting, gateway_process, move_off_cpus, print_table,
                     report_export, scratch_dir, summary, write_json)

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from agent.retrieval.v1 import retrieval_pb2
from gateway.chat import estimate_tokens
from gateway.history import history_window
from gateway.settings import GatewaySettings
from retrieval.convert import passage_to_proto
from retrieval.ingest import sample_corpus
from servicekit import ChannelSpec, ClientTls, load_settings, open_channel, wait_ready
from servicekit.procfs import descendants, thread_runqueue_wait_s
from servicekit.server import lower_priority
from servicekit.tasks import cancel_and_wait

SYSTEM = "You are a helpful assistant. Answer from the context when it is relevant."
QUESTIONS = ["How does the for statement work?", "What does with do?", "Explain try and except.",
             "How are classes defined?", "What is a lambda?", "How do imports work?"]
def sampling(max_tokens: int, temperature: float) -> inference_pb2.SamplingParams:
    """Exactly ``max_tokens`` generated (an answer of known length on every path), seeded."""
    return inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, ignore_eos=True)
DIRECT_CACHE_SALT = "bench-direct"


def _documents() -> list[retrieval_pb2.Document]:
    return [passage_to_proto(passage) for passage in sample_corpus(max_per_topic=2)[:120]]


def context_block(documents) -> str:
    """The passages as the gateway's prompt numbers them (``gateway.prompt.user_turn``)."""
    return "\n".join(f"[{i + 1}] {d.payload['text']}" for i, d in enumerate(documents))


def session_questions(level: int, worker: int):
    """A session's questions, in an order of its own (seeded: the same in every run).

    The answers are greedy and of fixed length, so a session's history is a
    function of its questions. Until 2026-12-06 worker i asked question
    (i + turn) mod 6, so sessions six workers apart held the same history
    turn for turn, and once the history window slid every session's prompt
    was one another session had sent before: at c=8 about half the turns
    found their whole prompt cached (by whichever path's partition got there
    first), which no real agent's sessions do. Drawn at random, two sessions
    share a first question, as real ones do, and rarely their first three.
    """
    draw = random.Random(f"{level}:{worker}")
    while True:
        yield draw.choice(QUESTIONS)


async def question_contexts(gateway, questions) -> dict[str, str]:
    """Each question's retrieved passages, searched once (untimed), for the direct path's prompts."""
    contexts = {}
    for question in questions:
        hits = (await gateway.Retrieve(pb.RetrieveRequest(request=retrieval_pb2.SearchRequest(
            collection="docs", text=question, top_k=3, payload_fields=["text"])), timeout=30)).response.results
        contexts[question] = context_block(hits)
    return contexts


def remember_turn(messages: list[pb.Message], question: str, turn: dict) -> None:
    """A stored turn's two messages, as the gateway stores them (``gateway.chat``: the question, the answer)."""
    ordinal = len(messages)
    messages += [pb.Message(ordinal=ordinal, role=inference_pb2.ROLE_USER, content=question,
                            token_count=estimate_tokens(question)),
                 pb.Message(ordinal=ordinal + 1, role=inference_pb2.ROLE_ASSISTANT, content=turn["answer"],
                            token_count=turn["completion_tokens"])]


async def sessions_unlike_the_store(gateway, kept: dict[str, list[pb.Message]]) -> int:
    """How many sessions' messages, as listed by the gateway, differ from those kept by :func:`remember_turn`."""
    def key(m: pb.Message) -> tuple:
        return m.ordinal, m.role, m.content, m.token_count

    unlike = 0
    for session, messages in kept.items():
        listed = (await gateway.ListMessages(pb.ListMessagesRequest(session_id=session, page_size=1000),
                                             timeout=30)).messages
        unlike += [key(m) for m in listed] != [key(m) for m in messages]
    return unlike


async def gateway_turn(stub, session: str, question: str, generation: inference_pb2.SamplingParams,
                       retrieve: bool = True) -> dict:
    started = time.perf_counter()
    first = final = context = None
    answer = []
    retrieval = pb.RetrievalOptions(collection="docs", top_k=3) if retrieve else None
    async for event in stub.Chat(pb.ChatRequest(
            session_id=session, message=question, system_prompt=SYSTEM, generation=generation,
            retrieval=retrieval), timeout=60):
        kind = event.WhichOneof("event")
        if kind == "delta":
            if first is None:
                first = (time.perf_counter() - started) * 1000
            answer.append(event.delta.text)
        elif kind == "final":
            final = event.final
        elif kind == "context":
            context = context_block(event.context.documents)
    if first is None:
        raise RuntimeError(f"a turn without a token: {final}")
    return {"ttft": first, "total": (time.perf_counter() - started) * 1000, "context": context,
            "answer": "".join(answer), "completion_tokens": final.usage.completion_tokens,
            # What the gateway's own clock misses: the call's way in (before the
            # handler runs) and the first token's way out.
            "edge": first - final.timings.first_token_ms,
            "history": final.timings.history_ms, "retrieval": final.timings.retrieval_ms,
            "engine_ttft": final.engine_timings.first_token_ms, "engine_queue": final.engine_timings.queue_ms,
            "cached": final.usage.cached_prompt_tokens, "prompt": final.usage.prompt_tokens}


async def direct_turn(stub, messages: list[inference_pb2.ChatMessage], generation: inference_pb2.SamplingParams) -> dict:
    started = time.perf_counter()
    first = result = None
    async for message in stub.Generate(inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(messages=messages), sampling=generation, cache_salt=DIRECT_CACHE_SALT),
            timeout=60):
        if first is None and message.text:  # as Chat counts it: the first visible text
            first = (time.perf_counter() - started) * 1000
        if message.HasField("result"):
            result = message.result
    if first is None:
        raise RuntimeError(f"a turn without a token: {result}")
    return {"ttft": first, "total": (time.perf_counter() - started) * 1000,
            "engine_ttft": result.timings.first_token_ms, "engine_queue": result.timings.queue_ms,
            "cached": result.usage.cached_prompt_tokens, "prompt": result.usage.prompt_tokens}


async def loop_lag(samples: list[float], every_s: float = 0.005) -> None:
    """How late this process's own timers fire, in ms, until cancelled.

    The bench's client shares the host's cores with the stack, and its own
    wait for a CPU is inside every first token it measures, the edge's above
    all (which counts the gateway path's way in and out at the client). Its
    lag is reported next to the edge so that the two can be told apart.
    """
    while True:
        started = time.perf_counter()
        await asyncio.sleep(every_s)
        samples.append((time.perf_counter() - started - every_s) * 1000)


def _wait_ms_per_s(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """This process's threads' wait for a CPU over a run, ms per second of it: the event loop's (``main``) and
    the rest's (gRPC's own threads)."""
    waited = {name: after[name] - before.get(name, 0.0) for name in after}
    loop = waited.pop("main", 0.0)
    return {"loop": loop * 1000 / wall_s, "other_threads": sum(waited.values()) * 1000 / wall_s}


#: The second gateway's tenant (--side-by-side): its own collections and prefix-cache partition.
OFF_TENANT = "bench-off"
#: --side-by-side: what the second gateway turns off (its label, its settings).
SIDE_BY_SIDE = {"early": ("early call off", {"AGW_GATEWAY_OPEN_GENERATE_EARLY": "false"}),
                "prefill": ("prefix prefill off", {"AGW_GATEWAY_PREFILL_PREFIX": "false"})}


async def run(ports: dict[str, int], tls: Path, turns: int, levels: list[int], window: GatewaySettings,
              generation: inference_pb2.SamplingParams, meter: CpuMeter, retrieve: bool = True) -> dict:
    def channel(port, identity):
        return open_channel(ChannelSpec(target=f"127.0.0.1:{port}", tls=ClientTls.for_identity(tls, identity)))

    gateways = {"gateway": ("gateway", "tenant/dev")}
    if "gateway_off" in ports:
        gateways["gateway_off"] = ("gateway_off", f"tenant/{OFF_TENANT}")
    async with AsyncExitStack() as stack:
        stubs = {}
        for path, (port_name, identity) in gateways.items():
            gw_channel = await stack.enter_async_context(channel(ports[port_name], identity))
            await wait_ready(gw_channel, timeout_s=30, target=path)
            stubs[path] = gateway_pb2_grpc.AgentGatewayStub(gw_channel)
            await stubs[path].IngestDocuments(pb.IngestDocumentsRequest(collection="docs", documents=_documents()),
                                              timeout=300)
        inf_channel = await stack.enter_async_context(channel(ports["inference"], "operator/admin"))
        await wait_ready(inf_channel, timeout_s=30, target="inference")
        gateway = stubs["gateway"]
        inference = inference_pb2_grpc.InferenceStub(inf_channel)
        # Without retrieval (--no-retrieval) a turn's prompt ends with the question alone, and Chat sends no context.
        contexts = await question_contexts(gateway, QUESTIONS) if retrieve else dict.fromkeys(QUESTIONS)
        results = []
        for concurrency in levels:
            sessions = {path: [(await stub.CreateSession(pb.CreateSessionRequest(), timeout=5)).session.id
                               for _ in range(concurrency)] for path, stub in stubs.items()}
            rows = {path: [] for path in (*stubs, "direct")}
            rows |= {f"{kind}{suffix}": [] for kind in ("refused", "failed", "other_context", "turns")
                     for suffix in ("", "_off")}
            per_worker = max(1, turns // concurrency)

            # The gateway path's sessions as the gateway stores them, kept here from what each turn streamed
            # (the direct prompts carry the same history window) and checked against the store once the
            # level is done: listing every session before every turn was load on the gateway and Postgres
            # that no real client adds.
            stored = {session: [] for session in sessions["gateway"]}

            def same_prompt(session: str, question: str) -> list[inference_pb2.ChatMessage]:
                """The prompt the gateway builds for this turn: system, history window, context + question."""
                history = history_window(list(reversed(stored[session]))[:window.history_messages],
                                         max_messages=window.history_messages,
                                         token_budget=window.history_token_budget,
                                         step=window.history_window_step).messages
                block = contexts[question]
                user = question if block is None else f"Context:\n{block}\n\nQuestion: {question}"
                return [inference_pb2.ChatMessage(role=inference_pb2.ROLE_SYSTEM, content=SYSTEM),
                        *(inference_pb2.ChatMessage(role=m.role, content=m.content) for m in history),
                        inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=user)]

            async def worker(index: int):
                questions = session_questions(concurrency, index)
                for turn in range(per_worker):
                    question = next(questions)
                    prompt = same_prompt(sessions["gateway"][index], question)
                    # The direct path runs in its own prefix-cache partition
                    # (a cache salt), so each path finds in the cache exactly
                    # what its own previous turns left there (the history) and
                    # neither reuses the other's prompt. The paths still take
                    # turns at going first, rotating every len(QUESTIONS)
                    # turns, so that what runs just before (another path's
                    # generation) weighs on all alike; and the workers start
                    # the rotation at different paths, so that the level's
                    # opening burst (every worker's first call at once, the
                    # engine handed c prompts together) falls on all paths
                    # alike. Until 2026-12-06 every worker called the gateway
                    # first, and Chat's first turns took the whole burst.
                    calls = {path: (lambda path=path: gateway_turn(stubs[path], sessions[path][index], question,
                                                                   generation, retrieve))
                             for path in stubs}
                    calls["direct"] = lambda: direct_turn(inference, prompt, generation)
                    order = list(calls)
                    shift = (index + turn // len(QUESTIONS)) % len(order)
                    measured = {}
                    ran = order[shift:] + order[:shift]
                    for path in ran:
                        try:
                            measured[path] = await calls[path]()
                        except grpc.aio.AioRpcError as error:  # counted, not timed; the run goes on
                            if path == "direct":
                                raise
                            # RESOURCE_EXHAUSTED: admission shed the turn; anything else failed it (reported).
                            kind = "refused" if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
                            rows[kind + ("_off" if path == "gateway_off" else "")].append(error.code().name)
                    direct = measured["direct"]
                    for path, suffix in (("gateway", ""), ("gateway_off", "_off")):
                        if path not in measured:
                            continue
                        via_gateway = measured[path]
                        rows[path].append(via_gateway)
                        if via_gateway["context"] != contexts[question]:  # degraded, or another search result
                            rows["other_context" + suffix].append(question)
                        # Paired: this turn's figures on the same prompt (TurnSample.share), kept in the JSON:
                        # the forms of the share can be recomputed, and a level's early turns told from its later.
                        stages = max(via_gateway["history"], via_gateway["retrieval"])
                        rows["turns" + suffix].append(TurnSample(
                            worker=index, turn=turn, chat=via_gateway["ttft"], stages=stages, direct=direct["ttft"],
                            chat_engine=via_gateway["engine_ttft"], direct_engine=direct["engine_ttft"],
                            chat_first=ran.index(path) < ran.index("direct"),
                            engine_queue=(via_gateway["engine_queue"], direct["engine_queue"]),
                            uncached=(via_gateway["prompt"] - via_gateway["cached"], direct["prompt"] - direct["cached"])))
                    rows["direct"].append(direct)
                    if "gateway" in measured:
                        remember_turn(stored[sessions["gateway"][index]], question, measured["gateway"])

            rows["client_lag"] = []
            probe = asyncio.create_task(loop_lag(rows["client_lag"]))
            waited, started, cpu = thread_runqueue_wait_s(os.getpid()), time.perf_counter(), meter.sample()
            await asyncio.gather(*(worker(i) for i in range(concurrency)))
            rows["cpu_s"] = CpuMeter.spent(cpu, meter.sample())
            rows["client_wait"] = _wait_ms_per_s(waited, thread_runqueue_wait_s(os.getpid()),
                                                 time.perf_counter() - started)
            await cancel_and_wait(probe)
            rows["other_history"] = await sessions_unlike_the_store(gateway, stored)
            results.append((concurrency, rows))
        return results


#: Which turns each process's CPU over a level is divided by: Chat's (the gateway's, and with --edge Envoy's,
#: retrieval's and Postgres's work is Chat's alone) or every turn (the inference service and its engine serve
#: both paths; the bench's client runs both). Read from /proc/<pid>/stat (10 ms ticks) before and after the level.
CPU_PER = {"gateway": "chat", "envoy": "chat", "retrieval": "chat", "postgres": "chat",
           "inference": "all", "engine": "all", "client": "all"}


def cpu_ms_per_turn(rows: dict, paths: Sequence[str]) -> dict[str, float]:
    """Each process group's CPU over the level, in ms per turn (``CPU_PER`` says which turns)."""
    chat = sum(len(rows[path]) for path in paths)
    turns = {"chat": chat, "all": chat + len(rows["direct"])}
    return {group: rows["cpu_s"][group] * 1000 / max(1, turns[per]) for group, per in CPU_PER.items()
            if group in rows["cpu_s"]}


@dataclass(frozen=True)
class TurnSample:
    """One turn of a level on one gateway path, ms: Chat's first token, its stages (max(history, retrieval)),
    and the same prompt's first token sent direct in the same turn; and each request's first token on the
    engine's own clock (arrival at the engine to first token), where the engine reported it."""

    worker: int
    turn: int  # the worker's (its session's) turn: 0 is a session's first
    chat: float
    stages: float
    direct: float
    chat_engine: float | None = None
    direct_engine: float | None = None
    chat_first: bool | None = None  # whether Chat ran before the direct call in this turn
    engine_queue: tuple[float, float] | None = None  # arrival at the engine to scheduling, (Chat's, direct's), ms
    uncached: tuple[int, int] | None = None  # prompt tokens the engine prefilled, (Chat's, direct's)

    @property
    def share(self) -> float:
        """This turn's gateway share of the first token, paired: Chat's, less its stages and the direct one."""
        return self.chat - self.stages - self.direct

    @property
    def engine_share(self) -> float:
        """The share's part on the engine's clock (arrival at the engine to first token): Chat's request's less
        the direct one's. The rest, :attr:`share` less this, is outside the engine (hops, and the gateway)."""
        return self.chat_engine - self.direct_engine

    def as_json(self) -> dict:
        figures = {"chat": self.chat, "stages": self.stages, "direct": self.direct,
                   "chat_engine": self.chat_engine, "direct_engine": self.direct_engine}
        pairs = {"engine_queue": self.engine_queue and [round(v, 3) for v in self.engine_queue],
                 "uncached": self.uncached and list(self.uncached), "chat_first": self.chat_first}
        return {"worker": self.worker, "turn": self.turn,
                **{key: round(value, 3) for key, value in figures.items() if value is not None},
                **{key: value for key, value in pairs.items() if value is not None}}


def share_forms(samples: Sequence[TurnSample]) -> dict[str, float]:
    """The gateway's share of the first token in three forms, and the skew between two of them, ms, from one
    level's turns.

    - ``p50_form``: p50(Chat) - (p50(stages) + p50(direct)), the form judged
      since the first wave;
    - ``sum_form``: p50(Chat) - p50(stages + direct): each turn's stages and
      its direct first token added before the median is taken, unpaired;
    - ``median_skew``: p50(stages + direct) - (p50(stages) + p50(direct)),
      their difference. It holds no gateway work at all (neither term has
      Chat's first token in it): the median of a sum of two right-skewed
      times exceeds the sum of their medians, and the p50 form charges that
      excess to the gateway;
    - ``mean``: mean(Chat) - mean(stages + direct), which is also the mean of
      each turn's own share, whichever way it is taken. A difference of
      medians is not the median of the differences where the two
      distributions differ in shape, not only in place, as they do here:
      Chat's first token is spread less than a sum of its stages and a
      direct first token (docs/benchmarks.md).
    """
    chat = statistics.median(s.chat for s in samples)
    stages = statistics.median(s.stages for s in samples)
    direct = statistics.median(s.direct for s in samples)
    expected = statistics.median(s.stages + s.direct for s in samples)
    return {"p50_form": chat - (stages + direct), "sum_form": chat - expected,
            "median_skew": expected - (stages + direct),
            "mean": statistics.fmean(s.share for s in samples)}


def _gateway_stats(rows: dict, path: str, suffix: str) -> dict:
    """One gateway's first-token share against the direct path, from the p50s and paired."""
    g, d = rows[path], rows["direct"]
    gateway_ttft, direct_ttft = summary([r["ttft"] for r in g]), summary([r["ttft"] for r in d])
    stage = statistics.median(max(r["history"], r["retrieval"]) for r in g)
    turns = rows["turns" + suffix]
    forms = share_forms(turns)
    return {"gateway_ttft": gateway_ttft, "direct_ttft": direct_ttft,
            "gateway_total": summary([r["total"] for r in g]), "direct_total": summary([r["total"] for r in d]),
            "history_retrieval_p50": stage,
            # Apart, to say which stage a level's first token waits on.
            "history": summary([r["history"] for r in g]), "retrieval": summary([r["retrieval"] for r in g]),
            # From the same turns as the other forms, so that p50 form - sum form is the skew exactly (the direct
            # path's p50 once included the turns the gateway refused).
            "gateway_share_p50": forms["p50_form"],
            "gateway_share_sum_form": forms["sum_form"], "median_skew": forms["median_skew"],
            "gateway_share_mean": forms["mean"],
            # Sessions' first turns (the level's opening burst) apart from their later ones: a short level at high
            # concurrency is mostly first turns.
            "paired_share_by_turn": {
                part: statistics.median(t.share for t in some) if some else None
                for part, some in (("first", [t for t in turns if t.turn == 0]),
                                   ("later", [t for t in turns if t.turn > 0]))},
            "turns": [sample.as_json() for sample in turns],
            "paired_share": summary([t.share for t in turns]),
            "paired_share_engine": summary([t.engine_share for t in turns]),
            "paired_share_outside_engine": summary([t.share - t.engine_share for t in turns]),
            "engine_ttft_p50": {"gateway": statistics.median(r["engine_ttft"] for r in g),
                                "direct": statistics.median(r["engine_ttft"] for r in d)},
            # The engine's queue, paired: arrival at the engine to scheduling, mostly the wait for the step in
            # progress (on CPU a prefill step is tens of ms), where requests that follow a stage land otherwise
            # than a closed-loop client's, which follow the step that ended its previous call.
            "paired_engine_queue": summary([t.engine_queue[0] - t.engine_queue[1] for t in turns if t.engine_queue]),
            "edge": summary([r["edge"] for r in g]), "client_loop_lag": summary(rows["client_lag"]),
            "client_runqueue_wait_ms_per_s": rows["client_wait"],
            "cpu_ms_per_turn": cpu_ms_per_turn(rows, [p for p in ("gateway", "gateway_off") if p in rows]),
            # How long the gateway's event-loop thread was runnable but not running (schedstat), per Chat turn.
            "gateway_runqueue_wait_ms_per_turn": rows["cpu_s"]["gateway_runqueue_wait"] * 1000 / max(1, len(g)),
            "refused": len(rows["refused" + suffix]),
            "other_context": len(rows["other_context" + suffix]),
            "other_history": rows["other_history"],
            "failed": sorted(rows["failed" + suffix]),
            "uncached_tokens_p50": {"gateway": statistics.median(r["prompt"] - r["cached"] for r in g),
                                    "direct": statistics.median(r["prompt"] - r["cached"] for r in d)}}


#: The goals on the share of the first token, p50 form, by level: the agent-turn goal at c=1 and c=8, and the
#: gateway-under-load goal (issue 13) at c=8. Levels without one print none.
SHARE_GOALS = {1: "goal <= +2 ms", 8: "goals: the agent turn's <= +2 ms, under load <= +4 ms"}
#: Chat's TTFT p99 against direct Generate's at the same level (issue 13).
P99_RATIO_GOALS = {32: "goal <= 2x"}


def _goal(goals: dict, concurrency: int) -> str:
    return f" ({goals[concurrency]})" if concurrency in goals else ""


def level_labels(levels: list[int]) -> list[str]:
    """Each level's name in the report: its concurrency, and which run of it when a level is given more than once
    (a repeat finds the earlier run's passages and questions in the prefix cache)."""
    seen: dict[int, int] = {}
    labels = []
    for level in levels:
        seen[level] = seen.get(level, 0) + 1
        labels.append(str(level) if seen[level] == 1 else f"{level} (run {seen[level]})")
    return labels


def _report(level: str, concurrency: int, label: str, s: dict) -> None:
    paired = s["paired_share"]
    print(f"c={level} {label}: max(history, retrieval) p50 {s['history_retrieval_p50']:.2f} ms (history p50 "
          f"{s['history']['p50']:.2f}, p99 {s['history']['p99']:.2f}; retrieval p50 {s['retrieval']['p50']:.2f}, p99 "
          f"{s['retrieval']['p99']:.2f}); gateway share "
          f"of the first token {s['gateway_share_p50']:+.2f} ms{_goal(SHARE_GOALS, concurrency)}, of which the "
          f"medians' skew {s['median_skew']:+.2f} (sum form {s['gateway_share_sum_form']:+.2f}; mean "
          f"{s['gateway_share_mean']:+.2f}); paired per turn: p50 "
          f"{paired['p50']:+.2f}, p95 {paired['p95']:+.2f} ms; of which outside the gateway's clock (way in, first "
          f"token out) p50 {s['edge']['p50']:.2f} ms (the bench client's own loop lag p50 "
          f"{s['client_loop_lag']['p50']:.2f}, p99 {s['client_loop_lag']['p99']:.2f}; its threads' wait for a CPU, "
          f"ms per s: loop {s['client_runqueue_wait_ms_per_s']['loop']:.0f}, gRPC's "
          f"{s['client_runqueue_wait_ms_per_s']['other_threads']:.0f}); uncached prompt tokens p50: "
          f"gateway {s['uncached_tokens_p50']['gateway']:.0f}, direct {s['uncached_tokens_p50']['direct']:.0f}")
    print(f"     paired share p99 {paired['p99']:+.2f} ms; gateway TTFT p99 {s['gateway_ttft']['p99']:.2f} ms vs "
          f"direct {s['direct_ttft']['p99']:.2f} ms ({s['gateway_ttft']['p99'] / s['direct_ttft']['p99']:.2f}x"
          f"{_goal(P99_RATIO_GOALS, concurrency)}); "
          f"refused RESOURCE_EXHAUSTED: {s['refused']}; failed: {s['failed'] or 'none'}; "
          f"turns whose context was not the direct prompt's: {s['other_context']}; sessions whose stored "
          f"history was not the direct prompts': {s['other_history']}")
    cpu = s["cpu_ms_per_turn"]
    print("     CPU ms per turn (Chat's: " + ", ".join(f"{g} {cpu[g]:.2f}" for g, per in CPU_PER.items()
                                               if per == "chat" and g in cpu)
          + "; every path's: " + ", ".join(f"{g} {cpu[g]:.2f}" for g, per in CPU_PER.items()
                                           if per == "all" and g in cpu)
          + f"); the gateway's loop waited for a CPU {s['gateway_runqueue_wait_ms_per_turn']:.2f} ms per Chat turn")
    by_turn = {part: "none" if v is None else f"{v:+.2f}" for part, v in s["paired_share_by_turn"].items()}
    print(f"     paired share p50, sessions' first turns {by_turn['first']} ms, later turns {by_turn['later']} ms")
    print(f"     split, paired p50: the engine's first token {s['paired_share_engine']['p50']:+.2f} ms "
          f"(engine TTFT p50 gateway {s['engine_ttft_p50']['gateway']:.2f}, "
          f"direct {s['engine_ttft_p50']['direct']:.2f}), "
          f"the rest (hops and gateway) {s['paired_share_outside_engine']['p50']:+.2f} ms; "
          f"the engine's queue (arrival to scheduling), paired: p50 {s['paired_engine_queue']['p50']:+.2f}, "
          f"mean {s['paired_engine_queue']['mean']:+.2f} ms")


def _start_edge(workdir: Path, tls: Path, ports: dict[str, int], gateway_port: int, started: list) -> int:
    from agentgw.edge_process import EdgeProcess
    from tests.support.servers import free_port

    port = free_port()
    edge = EdgeProcess(workdir, tls, listen=f"127.0.0.1:{port}", gateway=f"127.0.0.1:{gateway_port}",
                       inference=[f"127.0.0.1:{ports['inference']}"], retrieval=f"127.0.0.1:{ports['retrieval']}")
    started.append(edge)  # stopped with the processes (stop())
    edge.wait_answering()
    return port


#: The process groups --isolate-engine moves off the engine worker's CPUs.
PROCESS_GROUPS = ("gateway", "inference", "retrieval", "postgres", "client")


def _process_groups(text: str) -> tuple[str, ...]:
    groups = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [group for group in groups if group not in PROCESS_GROUPS]
    if not groups or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: name process groups from {', '.join(PROCESS_GROUPS)}")
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50, help="turns per path and concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="concurrency levels, in order; a level given twice runs twice, and the second run finds "
                             "the first's passages and questions in the prefix cache")
    parser.add_argument("--window-step", type=int, default=None,
                        help="AGW_GATEWAY_HISTORY_WINDOW_STEP for the gateway (2: the window slides every turn)")
    parser.add_argument("--side-by-side", choices=sorted(SIDE_BY_SIDE), nargs="?", const="early",
                        help="also a gateway with the early call (early) or the prefix prefill (prefill) off, "
                             "on the same turns")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="tokens each turn generates: the answer the next turn's history carries")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="1.0 for long answers: greedy, the smoke model can settle on tokens that decode to no "
                             "text, and a turn without text has no first token")
    parser.add_argument("--backend-nice", type=int, default=0,
                        help="AGW_INFERENCE_NICE and AGW_RETRIEVAL_NICE; the bench's own process "
                             "takes it too once the stack is up, so the load competes for CPU as the backends do, "
                             "and only the gateway (and Postgres) keep nice 0")
    parser.add_argument("--edge", action="store_true",
                        help="Chat through the edge (Envoy as `agentgw up --edge` runs it) in front of the gateway: "
                             "the share then includes Envoy's hop")
    parser.add_argument("--no-retrieval", action="store_true",
                        help="turns without retrieval (an agent's tool-loop steps): the stages are the history alone")
    parser.add_argument("--isolate-engine", type=_process_groups, default=(), metavar="GROUPS",
                        help="comma-separated, from " + ", ".join(PROCESS_GROUPS) + ": moved off the CPUs vLLM's "
                             "CPU worker bound, once the stack is up, so that the worker has them to itself")
    parser.add_argument("--export-traces", type=export_ratio, metavar="all|RATIO",
                        help="every service exports its traces (all) or that ratio of them (OpenTelemetry's "
                             "parentbased_traceidratio) to a sink that counts them (trace_sink.py); off by default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    step = {} if args.window_step is None else {"history_window_step": args.window_step}
    window = load_settings(GatewaySettings, **step)  # the bench's direct prompts use the gateway's window
    root = scratch_dir("chat")
    tls = dev_pki(root, tenants=("dev", OFF_TENANT) if args.side_by_side else ("dev",))
    backend_env = {"AGW_INFERENCE_NICE": str(args.backend_nice), "AGW_RETRIEVAL_NICE": str(args.backend_nice)}
    if args.edge:  # the bench's own Retrieve calls (the direct path's context) go through the edge straight to
        # retrieval, which admits them as the gateway would; unbounded, as in the other benches
        backend_env.update(AGW_INFERENCE_EDGE_CLIENTS="service/edge", AGW_RETRIEVAL_EDGE_CLIENTS="service/edge",
                           **UNBOUNDED_ADMISSION)
    with (exporting(args.export_traces) as sink,
          backend_processes(root, tls, **backend_env, **export_environment(sink)) as (ports, started)):
        variants, gateway_pids, edge_pids = {"gateway": {}}, [], []
        if args.side_by_side:
            variants["gateway_off"] = SIDE_BY_SIDE[args.side_by_side][1]
        for name, env in variants.items():
            gateway = gateway_process(root, tls, name, ports,
                                      AGW_GATEWAY_HISTORY_WINDOW_STEP=str(window.history_window_step),
                                      **({"AGW_GATEWAY_EDGE_CLIENTS": "service/edge"} if args.edge else {}),
                                      **export_environment(sink), **env)
            started.append(gateway)
            gateway_pids.append(gateway.pid)
            ports[name] = gateway.wait_serving()
            if args.edge:  # the client's Chat goes to the edge, which sends it on to this gateway
                ports[name] = _start_edge(root / f"edge-{name}", tls, ports, ports[name], started)
                edge_pids.append(started[-1].pid)
        lower_priority(args.backend_nice)
        inference_pid, retrieval_pid = ports["inference_pid"], ports["retrieval_pid"]
        if args.isolate_engine:
            groups = {"gateway": [*gateway_pids, *edge_pids], "inference": [inference_pid],
                      "retrieval": [retrieval_pid], "postgres": [ports["postgres_pid"]], "client": [os.getpid()]}
            cpus = engine_worker_cpus(inference_pid)
            kept, moved = move_off_cpus([pid for group in args.isolate_engine for pid in groups[group]], cpus)
            print(f"the engine worker's CPUs {sorted(cpus)} to itself: {moved} threads of "
                  f"{', '.join(args.isolate_engine)} moved off them, {kept} of the worker's left bound", flush=True)
        meter = CpuMeter({
            "gateway": lambda: [pid for gateway in gateway_pids for pid in (gateway, *descendants(gateway))],
            **({"envoy": lambda: edge_pids} if edge_pids else {}),
            "inference": lambda: [inference_pid], "engine": lambda: sorted(descendants(inference_pid)),
            "retrieval": lambda: [retrieval_pid],
            "postgres": lambda: [ports["postgres_pid"], *descendants(ports["postgres_pid"])],
            "client": lambda: [os.getpid()]})
        results = asyncio.run(run(ports, tls, args.turns, args.concurrency, window,
                                  sampling(args.max_tokens, args.temperature), meter, not args.no_retrieval))

    table, stats = [], {}
    off_label = SIDE_BY_SIDE[args.side_by_side][0] if args.side_by_side else ""
    for level, (concurrency, rows) in zip(level_labels(args.concurrency), results):
        stats[level] = _gateway_stats(rows, "gateway", "")
        stats[level]["concurrency"] = concurrency
        if "gateway_off" in rows:
            stats[level]["off"] = _gateway_stats(rows, "gateway_off", "_off")
        paths = [("gateway Chat", stats[level])]
        if "off" in stats[level]:
            paths.append((f"gateway Chat, {off_label}", stats[level]["off"]))
        for name, s in paths:
            table.append({"conc": level, "path": name, "turns": s["gateway_ttft"]["n"], "refused": s["refused"],
                          "share p50": s["paired_share"]["p50"], "share p99": s["paired_share"]["p99"],
                          "TTFT p50": s["gateway_ttft"]["p50"], "TTFT p95": s["gateway_ttft"]["p95"],
                          "TTFT p99": s["gateway_ttft"]["p99"], "total p50": s["gateway_total"]["p50"],
                          "total p99": s["gateway_total"]["p99"]})
        direct = stats[level]
        table.append({"conc": level, "path": "direct Generate", "turns": direct["direct_ttft"]["n"],
                      "TTFT p50": direct["direct_ttft"]["p50"], "TTFT p95": direct["direct_ttft"]["p95"],
                      "TTFT p99": direct["direct_ttft"]["p99"], "total p50": direct["direct_total"]["p50"],
                      "total p99": direct["direct_total"]["p99"]})
    print_table(f"agent turn: first token and total, ms ({args.max_tokens} tokens, smoke model)", table,
                ["conc", "path", "turns", "refused", "share p50", "share p99", "TTFT p50", "TTFT p95", "TTFT p99",
                 "total p50", "total p99"])
    for level, s in stats.items():
        _report(level, s["concurrency"], "gateway", s)
        if "off" in s:
            _report(level, s["concurrency"], f"gateway, {off_label}", s["off"])
    traces = report_export(sink)
    print(f"command: {command_line()}")
    write_json(args.json, {"stats": stats, "trace_export": traces})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
