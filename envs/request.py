"""The one request record of the project, and a trace as a sequence of them.

A request's prefix identity is kept compact: instead of block hashes it names the earlier request
whose prefix it extends (``parent_id``) and how many leading tokens the two share
(``shared_prefix_tokens``). Block hashes are chained in every public trace we load (a block implies
its whole prefix), so this is lossless up to the block size, and it makes cache lookups cheap.

Arrivals are either open-loop (``arrival_s`` is the time the request arrives) or closed-loop (agent
sessions): a closed-loop request is released ``think_time_s`` after the request it ``depends_on``
finished, or ``think_time_s`` after its session started when ``depends_on == -1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM request as the cluster sees it."""

    request_id: int
    """Unique within a trace; requests are stored in ``request_id`` order (0, 1, 2, ...)."""
    session_id: int
    """Conversation / agent session (sub-agents share their parent's session). -1 when unknown."""
    turn: int
    """0-based position within the session (sub-agent requests counted in release order)."""
    arrival_s: float
    """Open-loop arrival time in seconds from trace start; for closed-loop traces, the time in the
    original recording (informational: the simulator releases closed-loop requests itself)."""
    input_tokens: int
    output_tokens: int
    parent_id: int = -1
    """Earlier request (smaller id) whose input prefix this request's input extends; -1 for none."""
    shared_prefix_tokens: int = 0
    """Leading input tokens shared with ``parent_id``'s input (0 when ``parent_id == -1``)."""
    depends_on: int = -1
    """Closed-loop only: the request whose completion releases this one; -1 = session start."""
    think_time_s: float = 0.0
    """Closed-loop only: delay after ``depends_on`` finished (or after session start)."""


@dataclass(slots=True)
class Trace:
    """A named, ordered list of requests plus how their arrivals are produced."""

    name: str
    requests: list[Request]
    closed_loop: bool = False
    """True for agent sessions: arrivals depend on how fast the cluster serves."""
    source: str = ""
    """Where the data came from (file, upstream repository, license)."""
    block_size_tokens: int = 0
    """Prefix-hash block size of the original trace (0 if it had no prefix information)."""
    meta: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def session_ids(self) -> list[int]:
        """Distinct session ids in first-appearance order."""
        seen: dict[int, None] = {}
        for r in self.requests:
            seen.setdefault(r.session_id, None)
        return list(seen)
