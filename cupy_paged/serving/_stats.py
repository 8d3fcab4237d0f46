"""What ``Scheduler.stats()`` reports: counts kept as the scheduler goes, read in O(1)."""
from __future__ import annotations

import dataclasses
import types


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler and its cache (``Scheduler.stats()``).

    Attributes
    ----------
    num_running, num_waiting : int
        Requests running (holding cache blocks) and queued.
    num_preempted : int
        Queued requests that were preempted and wait for recomputation (among ``num_waiting``).
    num_preemptions : int
        Preemptions so far.
    num_finished, num_aborted : int
        Requests (branches counted one each) finished and aborted so far.
    blocks_used, blocks_total : int
        Cache blocks held by sequences (not free, not cached free) and all blocks.
    prompt_tokens, cached_prompt_tokens : int
        Prompt tokens of requests admitted so far (first admission), and how many of them
        the prefix cache supplied.
    prefill_tokens, decode_tokens : int
        Tokens scheduled so far: prompt (and recomputation) chunks, and decodes.
    cached_prompt_tokens_by_request : Mapping
        Request id -> prompt tokens the prefix cache supplied at its first admission, for
        the live requests admitted so far (a read-only view, not a copy).
    """

    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    blocks_used: int
    blocks_total: int
    prompt_tokens: int
    cached_prompt_tokens: int
    prefill_tokens: int
    decode_tokens: int
    cached_prompt_tokens_by_request: types.MappingProxyType

    @property
    def cache_usage(self) -> float:
        """``blocks_used / blocks_total``."""
        return self.blocks_used / self.blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        """``cached_prompt_tokens / prompt_tokens`` (0 before any admission)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass
class Counters:
    """The scheduler's running totals (rolled back with a step)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_preempted_waiting: int = 0
    num_finished: int = 0
    num_aborted: int = 0
