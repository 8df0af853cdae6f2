"""``agentgw chat``: a real mTLS client of ``AgentGateway.Chat``, for one question or a conversation.

Tokens print as they arrive, then the retrieved sources, one timing line and
the trace id. ``--json`` prints every event as one JSON object per line
instead, for scripts. Without a question it reads questions from the
terminal (or stdin), all in one session, so later turns see earlier ones.

``--tools FILE`` runs a small local tool loop: the tools in FILE (a JSON list
of ``{"name", "description", "parameters"}``) are offered to the model; when it
calls one, the call and its result are printed and the result goes back on the
next turn of the session, until the model answers or ``--max-steps`` is
reached. ``search_docs`` (arguments ``{"query"}``) is run against the
gateway's Retrieve, on the tenant's ``--collection``; a tool with no local
implementation answers with an error object, which the model sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from agent.gateway.v1 import gateway_pb2 as pb
from agent.gateway.v1 import gateway_pb2_grpc
from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.channels import wait_ready
from agentgw.connection import Connection, NoConnection


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("question", nargs="?", help="ask this and exit (default: read questions interactively)")
    parser.add_argument("--json", action="store_true", help="print raw events as JSON lines")
    parser.add_argument("--session", help="continue this session (default: a new one)")
    parser.add_argument("--collection", default="docs", help="retrieve context from this collection (default docs)")
    parser.add_argument("--no-retrieval", action="store_true", help="answer without retrieved context")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--target", help="gateway address (default: from $AGW_HOME/connection.json)")
    parser.add_argument("--tls-dir", type=Path, help="TLS folder with ca.pem and the client certificate")
    parser.add_argument("--identity", default="dev", help="client certificate (tenant) to use, with --target")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline per turn, in seconds")
    parser.add_argument("--tools", type=Path, help="JSON file of tools to offer the model; runs a local tool loop")
    parser.add_argument("--tool-choice", default="auto",
                        help="first step: auto, required, none, or a tool's name (later steps: auto)")
    parser.add_argument("--max-steps", type=int, default=4, help="most turns in one tool loop")


def timing_line(final: pb.TurnSummary) -> str:
    t, usage = final.timings, final.usage
    line = (f"history {t.history_ms:.1f} ms | retrieval {t.retrieval_ms:.1f} ms | first token {t.first_token_ms:.1f} ms"
            f" (engine {final.engine_timings.first_token_ms:.1f} ms) | total {t.total_ms:.1f} ms | cached {usage.cached_prompt_tokens}/{usage.prompt_tokens} prompt tokens")
    return line + (f" | DEGRADED: {final.degraded_reason}" if final.degraded else "")


class ChatClient:
    def __init__(self, stub: gateway_pb2_grpc.AgentGatewayStub, args: argparse.Namespace, out=sys.stdout) -> None:
        self.stub = stub
        self.args = args
        self.out = out
        self.session = args.session or ""
        self.tools = load_tools(args.tools) if getattr(args, "tools", None) else []

    def _request(self, question: str, tool_results=(), step: int = 0) -> pb.ChatRequest:
        request = pb.ChatRequest(session_id=self.session, message=question, tools=self.tools,
                                 tool_results=tool_results,
                                 generation=inference_pb2.SamplingParams(max_tokens=self.args.max_tokens))
        if self.tools:
            request.tool_choice.CopyFrom(tool_choice(self.args.tool_choice if step == 0 else "auto"))
        if not self.args.no_retrieval and question:
            request.retrieval.CopyFrom(pb.RetrievalOptions(
                collection=self.args.collection, top_k=self.args.top_k, payload_fields=["text", "source"]))
        return request

    async def turn(self, question: str) -> pb.TurnSummary | None:
        """One question; with tools, the loop of turns it takes (each call run here, its result sent back)."""
        if not self.session:
            self.session = (await self.stub.CreateSession(pb.CreateSessionRequest(), timeout=10)).session.id
        final, calls = await self._step(self._request(question))
        for step in range(1, self.args.max_steps):
            if not calls:
                break
            results = [pb.ToolResult(tool_call_id=call.id, content=await self._run_tool(call)) for call in calls]
            final, calls = await self._step(self._request("", results, step))
        if calls and not self.args.json:
            print(f"(stopped after --max-steps {self.args.max_steps}; the last calls were not run)", file=self.out)
        return final

    async def _run_tool(self, call) -> str:
        result = await run_local_tool(self.stub, call, self.args)
        if not self.args.json:
            print(f"  -> {result[:300]}", file=self.out, flush=True)
        return result

    async def _step(self, request: pb.ChatRequest):
        final, sources, calls = None, [], []
        async for event in self.stub.Chat(request, timeout=self.args.timeout):
            if self.args.json:
                print(json.dumps(MessageToDict(event)), file=self.out, flush=True)
            kind = event.WhichOneof("event")
            if kind == "delta" and not self.args.json:
                print(event.delta.text, end="", file=self.out, flush=True)
            elif kind == "context":
                sources = list(event.context.documents)
            elif kind == "tool_call":
                calls.append(event.tool_call.call)
                if not self.args.json:
                    print(f"\ntool call {event.tool_call.call.name}({event.tool_call.call.arguments}) "
                          f"[{event.tool_call.call.id}]", file=self.out, flush=True)
            elif kind == "final":
                final = event.final
        if not self.args.json and final is not None:
            print(file=self.out)
            for index, document in enumerate(sources, 1):
                source = document.payload["source"] if "source" in document.payload else ""
                print(f"  [{index}] {document.id} (score {document.score:.3f}) {source}", file=self.out)
            print(timing_line(final), file=self.out)
            print(f"trace {final.trace_id}  (agentgw trace {final.trace_id}, or Jaeger: "
                  f"http://localhost:16686/trace/{final.trace_id})", file=self.out, flush=True)
        return final, calls


def load_tools(path: Path) -> list[inference_pb2.Tool]:
    """Tools from a JSON file: a list of {"name", "description", "parameters" (a JSON Schema object)}."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of tools")
    return [inference_pb2.Tool(name=entry["name"], description=entry.get("description", ""),
                               parameters=json.dumps(entry.get("parameters", {"type": "object"})))
            for entry in entries]


def tool_choice(value: str) -> inference_pb2.ToolChoice:
    modes = {"auto": inference_pb2.TOOL_CHOICE_MODE_AUTO, "none": inference_pb2.TOOL_CHOICE_MODE_NONE,
             "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED}
    if value in modes:
        return inference_pb2.ToolChoice(mode=modes[value])
    return inference_pb2.ToolChoice(tool_name=value)


async def run_local_tool(stub: gateway_pb2_grpc.AgentGatewayStub, call, args) -> str:
    """The local implementations: search_docs through the gateway's Retrieve; anything else is an error object."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        return json.dumps({"error": "the arguments are not JSON"})
    if call.name != "search_docs":
        return json.dumps({"error": f"no local implementation of {call.name}"})
    search = retrieval_pb2.SearchRequest(collection=args.collection, text=str(arguments.get("query", "")) or " ",
                                         top_k=args.top_k, payload_fields=["text", "source"])
    try:
        found = await stub.Retrieve(pb.RetrieveRequest(request=search), timeout=args.timeout)
    except grpc.aio.AioRpcError as exc:
        return json.dumps({"error": f"{exc.code().name}: {exc.details()}"})
    return json.dumps([{"id": d.id, "text": d.payload["text"][:400] if "text" in d.payload else ""}
                       for d in found.response.results])


async def _questions(args: argparse.Namespace):
    if args.question:
        yield args.question
        return
    interactive = sys.stdin.isatty()
    while True:
        try:  # the terminal is read off the event loop, like any blocking call
            line = await asyncio.to_thread(input, "you> ") if interactive else await asyncio.to_thread(sys.stdin.readline)
        except EOFError:
            return
        if not interactive and not line:
            return
        if line.strip():
            yield line.strip()


async def _run(args: argparse.Namespace, connection: Connection) -> int:
    async with connection.gateway_channel() as channel:
        await wait_ready(channel, timeout_s=10, target=connection.gateway)
        client = ChatClient(gateway_pb2_grpc.AgentGatewayStub(channel), args)
        async for question in _questions(args):
            await client.turn(question)
    return 0


def main(args: argparse.Namespace, settings) -> int:
    try:
        connection = Connection.for_cli(settings, args.target, args.tls_dir, args.identity)
        return asyncio.run(_run(args, connection))
    except NoConnection as exc:
        print(f"agentgw chat: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"agentgw chat: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError, TimeoutError) as exc:
        print(f"agentgw chat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
