"""Which inference replica serves a call: rendezvous hashing with bounded load, and two plain policies.

Every gateway worker and pod must send a session to the same replica without
talking to each other, so the choice is a pure function of what they all
know: the call's key and the replicas' names (and, to bound load, the loads
each replica pushes on ``WatchLoad``).

Rendezvous (highest-random-weight) hashing ranks the replicas for a key by a
hash of (key, replica name). Every process computes the same ranking; when a
replica leaves, only the keys it ranked first move (each to its own next
choice), and they come back when it returns. A consistent-hash ring gives the
same property with a ring to maintain; with a handful of replicas, ranking
them all per call costs a few microseconds and needs no state.

Bounded load: the first-ranked replica serves the key unless it is *full*
(a new call would wait in its queue) and its load exceeds the least-loaded
replica's by more than the margin; then the next in the key's ranking that is
within the bound or not full does (a *spill*), so a hot session or tenant
moves to one other replica, not to whichever is idle.

Why "full" as well as the margin: a spill costs the whole prompt's prefill on
a replica without its prefix, and evicts that replica's own sessions from its
cache; joining a batch with room costs one more sequence per decode step. A
margin alone spills off a replica that has room: a margin of 4 is nothing
beside a GPU's batch of hundreds, and on the replica bench it spilled up to
18% of turns and cost up to a fifth of the cached tokens (docs/benchmarks.md). SMG's cache-aware
policy makes the same trade with balance thresholds (64 requests, 1.5x).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

R = TypeVar("R")


class Reason(str, Enum):
    """Why a call went to its replica (a metric label and a span attribute)."""

    AFFINITY = "affinity"  # the key's first-ranked replica
    SPILL = "spill"  # the first-ranked was over the load bound: the next in the ranking within it
    RETRY = "retry"  # the call failed before its first token on another replica
    BALANCED = "balanced"  # least_loaded or round_robin: no key


class Policy(str, Enum):
    AFFINITY = "affinity"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


def score(key: bytes, name: str) -> int:
    """The replica's weight for ``key``: the same in every process (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest(), "big")


def rank(key: bytes, names: Sequence[str]) -> list[int]:
    """Indexes of ``names`` from the key's first choice to its last (highest score first; ties by name)."""
    return sorted(range(len(names)), key=lambda i: (-score(key, names[i]), names[i]))


@dataclass(frozen=True)
class Choice(Generic[R]):
    """A call's replica, and why (a retry chooses again, without the replica that failed)."""

    replica: R
    reason: Reason


class Router(Generic[R]):
    """Chooses among candidate replicas; ``name``, ``load`` and ``full`` read a replica's name, current load, and
    whether a new call would wait in its queue (the load bound passes over only a full replica)."""

    def __init__(self, policy: Policy, name: Callable[[R], str], load: Callable[[R], float], *,
                 margin: float, full: Callable[[R], bool] = lambda replica: True) -> None:
        self.policy = policy
        self._name = name
        self._load = load
        self._full = full
        self.margin = margin
        self._turn = itertools.count()

    def choose(self, key: bytes, candidates: Sequence[R]) -> Choice[R]:
        """The replica for ``key`` among ``candidates`` (not empty)."""
        if len(candidates) == 1:
            return Choice(candidates[0], Reason.AFFINITY if self.policy is Policy.AFFINITY else Reason.BALANCED)
        if self.policy is Policy.ROUND_ROBIN:
            return Choice(candidates[next(self._turn) % len(candidates)], Reason.BALANCED)
        ranked = [candidates[i] for i in rank(key, [self._name(c) for c in candidates])]
        loads = [self._load(c) for c in ranked]
        if self.policy is Policy.LEAST_LOADED:  # ties go to the key's ranking (min keeps the first): stable
            return Choice(ranked[min(range(len(ranked)), key=loads.__getitem__)], Reason.BALANCED)
        bound = min(loads) + self.margin
        chosen = next(i for i, load in enumerate(loads) if load <= bound or not self._full(ranked[i]))
        return Choice(ranked[chosen], Reason.AFFINITY if chosen == 0 else Reason.SPILL)


class Placement:
    """Ids for new sessions, drawn so that the sessions this worker creates spread evenly over the replicas.

    A session's replica is its key's first in the ranking, so a hash decides
    the split, and with few sessions a hash splits unevenly: 24 sessions over
    two replicas split 8/16 or worse about one time in seven, and the busier
    replica's cache overflows while the other's idles (the replica bench,
    docs/benchmarks.md). The gateway creates session ids, so it can choose one
    that its key ranks where this worker has placed the fewest sessions: it
    draws random ids until one does (two draws on average with two replicas).
    Routing itself is unchanged, a pure function of the key and the names, so
    every worker and pod still agrees on a session's replica without state;
    only the counts that guide the choice are this worker's own. Each worker
    balancing its own sessions balances their sum.
    """

    def __init__(self, *, draws_per_replica: int = 8, new_id: Callable[[], uuid.UUID] = uuid.uuid4,
                 rng: random.Random | None = None) -> None:
        #: Sessions this worker placed, by replica name.
        self.placed: Counter[str] = Counter()
        self._draws_per_replica = draws_per_replica
        self._new_id = new_id
        self._rng = rng or random.Random()

    def session_id(self, key_of: Callable[[str], bytes], names: Sequence[str]) -> str:
        """A new session id whose key (``key_of(id)``) ranks first the replica among ``names`` with the fewest
        sessions placed; a replica new to this worker starts level with the least placed, so a joining replica
        takes its share of new sessions, not all of them until it catches up. Ties go by chance, so workers
        that each create a few sessions do not all pick the same replica."""
        if len(names) < 2:
            return str(self._new_id())
        floor = min((self.placed[n] for n in names if n in self.placed), default=0)
        for name in names:
            self.placed.setdefault(name, floor)
        fewest = min(self.placed[n] for n in names)
        target = self._rng.choice([n for n in names if self.placed[n] == fewest])
        for _ in range(self._draws_per_replica * len(names)):  # each draw hits the target with chance 1/len(names)
            candidate = str(self._new_id())
            first = names[rank(key_of(candidate), names)[0]]
            if first == target:
                break
        self.placed[first] += 1  # missing the target 8 draws running per replica (1 in 10^5 with two) just counts
        return candidate


def prefix_key(salt: str, parts: Sequence[str], max_chars: int) -> bytes:
    """A stateless call's key: its cache salt and the leading ``max_chars`` of its prompt's text.

    Calls that share a system prompt and first messages share a key, so they
    meet the same replica's prefix cache; the salt keeps tenants apart as the
    engine's cache does.
    """
    taken, size = [], 0
    for part in parts:
        taken.append(part[: max_chars - size])
        size += len(taken[-1])
        if size >= max_chars:
            break
    return b"prefix\0" + salt.encode() + b"\0" + "\x1f".join(taken).encode()


def session_key(salt: str, session_id: str) -> bytes:
    """A session turn's key: its tenant's cache salt and the session, known before the history is."""
    return b"session\0" + salt.encode() + b"\0" + session_id.encode()


def generate_key(request, max_chars: int) -> bytes:
    """A ``Generate`` call's key (an ``inference_pb2.GenerateRequest``): its salt and its prompt's leading text."""
    which = request.WhichOneof("input")
    if which == "chat":
        parts = [message.content for message in request.chat.messages]
    elif which == "token_ids":
        parts = [",".join(map(str, request.token_ids.ids[: max_chars // 2]))]
    else:
        parts = [request.prompt]
    return prefix_key(request.cache_salt, parts, max_chars)
