"""What the scheduler works with: requests and their progress, and the limits of one step."""
from __future__ import annotations

import dataclasses
import enum

__all__ = ["Request", "RequestStatus", "SchedulerConfig"]


class RequestStatus(enum.Enum):
    """Where a request is: waiting for (re)admission, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and a generation limit, plus its progress.

    Parameters
    ----------
    request_id : hashable
        Unique among live requests.
    prompt_token_ids : list of int
        At least one token.
    max_new_tokens : int
        Stop after this many generated tokens (>= 1).
    eos_token_id : int, optional
        Stop early after generating this token.

    Attributes
    ----------
    token_ids : list of int
        Prompt then generated tokens (the cache hashes blocks from this list).
    num_computed : int
        Leading tokens whose K/V is in the cache.
    num_preemptions : int
        Times the request was preempted and recomputed.

    Examples
    --------
    >>> r = Request("a", [1, 2, 3], max_new_tokens=2)
    >>> r.num_tokens, r.output_token_ids, r.status.value
    (3, [], 'waiting')
    """

    request_id: object
    prompt_token_ids: list
    max_new_tokens: int
    eos_token_id: int | None = None
    token_ids: list = dataclasses.field(init=False)
    num_computed: int = dataclasses.field(init=False, default=0)
    num_preemptions: int = dataclasses.field(init=False, default=0)
    status: RequestStatus = dataclasses.field(init=False, default=RequestStatus.WAITING)

    def __post_init__(self):
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must hold at least one token")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be >= 1; got {self.max_new_tokens}")
        self.max_new_tokens = int(self.max_new_tokens)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list:
        """The generated tokens."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        """The longest this request can get: prompt plus ``max_new_tokens``."""
        return len(self.prompt_token_ids) + self.max_new_tokens


@dataclasses.dataclass
class SchedulerConfig:
    """Limits of one step.

    Parameters
    ----------
    max_batch_tokens : int
        Token budget of a step (decodes count one each).
    max_num_seqs : int
        Most running requests; must not exceed ``max_batch_tokens``.
    max_prefill_chunk : int, optional
        Most tokens of one prompt in one step (default: the whole budget).
    admission_margin : float
        Fraction of the cache's blocks that must stay free after admitting a waiting
        request while others run, so running decodes do not preempt it at once.

    Examples
    --------
    >>> SchedulerConfig(max_batch_tokens=512, max_num_seqs=64).max_prefill_chunk
    512
    """

    max_batch_tokens: int = 2048
    max_num_seqs: int = 256
    max_prefill_chunk: int | None = None
    admission_margin: float = 0.02

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= max_batch_tokens "
                             f"({self.max_batch_tokens}): every running decode must fit one step")
        if self.max_prefill_chunk is None:
            self.max_prefill_chunk = self.max_batch_tokens
        if self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1; got {self.max_prefill_chunk}")
        if not 0.0 <= self.admission_margin < 1.0:
            raise ValueError(f"admission_margin must be in [0, 1); got {self.admission_margin}")
