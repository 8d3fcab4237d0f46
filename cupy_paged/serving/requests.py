"""What the scheduler works with: requests, their sampling parameters and progress, and the
limits of one step."""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers

import numpy as np

from .._core.types import check_bool, check_int, check_real

__all__ = ["Request", "RequestStatus", "SamplingParams", "SchedulerConfig"]


class RequestStatus(enum.Enum):
    """Where a request is: waiting for (re)admission, running, finished, or aborted."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


def _token_set(ids) -> frozenset:
    """One token id, several, or None as a frozenset of ints."""
    if ids is None:
        return frozenset()
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"eos_token_id / stop_token_ids must be token ids (ints); got {ids!r}")
    if isinstance(ids, numbers.Integral):
        return frozenset((check_int(ids, "eos_token_id"),))
    return frozenset(check_int(t, "eos_token_id / stop_token_ids") for t in ids)


# Token ids reach the model as int32 (StepPlan.input_ids): a larger one would wrap.
TOKEN_ID_MAX = 2 ** 31 - 1


def token_array(tokens, name: str):
    """``tokens`` as a flat int64 NumPy array, checked before the cast: ints (7.5 is no token id),
    each in ``[0, 2**31 - 1]``."""
    array = np.asarray(tokens)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be token ids (ints); got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > TOKEN_ID_MAX):  # in its own dtype: no wrap yet
        bad = int(array[(array < 0) | (array > TOKEN_ID_MAX)].flat[0])
        raise ValueError(f"{name} must be token ids in [0, {TOKEN_ID_MAX}]; got {bad}")
    return array.astype(np.int64, copy=False).reshape(-1)


def _prompt_ids(tokens, name: str) -> list:
    """``tokens`` as a list of Python ints >= 0.  Plain ints (or a NumPy integer array) are checked
    in one pass (about 20x faster than checking each of 500 ids); anything else id by id, which
    names the bad one."""
    if isinstance(tokens, np.ndarray):
        if (tokens.ndim == 1 and tokens.size and tokens.dtype.kind in "iu" and tokens.min() >= 0
                and int(tokens.max()) <= TOKEN_ID_MAX):
            return tokens.tolist()
    else:
        tokens = list(tokens)
        if tokens and set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= TOKEN_ID_MAX:
            return tokens
    return [check_int(t, name, 0, TOKEN_ID_MAX) for t in tokens]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are sampled and when it stops.

    The scheduler reads ``max_new_tokens``, ``stop_token_ids``, ``ignore_eos`` and ``n``; the
    rest travels with the request to the model code, which samples (each sampled row of a step
    names its request: ``ScheduledBatch.sample_requests``, ``StepPlan.sample_requests``).

    Parameters
    ----------
    temperature : float
        0 for greedy.
    top_p : float
        In (0, 1].
    top_k : int
        0 for no limit.
    seed : int, optional
        A branch ``k`` of ``n`` parallel samples should sample with ``seed + k``
        (``Request.sample_index``).
    max_new_tokens : int, optional
        Used when the request gives none.
    stop_token_ids : iterable of int, optional
        Stop after generating any of these, as well as after the request's EOS ids.
    ignore_eos : bool
        Do not stop at the EOS ids (``stop_token_ids`` still stop).
    n : int
        Parallel samples: the prompt is computed once, then forked (sharing its blocks,
        copy-on-write) into ``n`` branches that sample independently.

    Examples
    --------
    >>> from cupy_paged import SamplingParams
    >>> SamplingParams(stop_token_ids=[7, 7, 9], n=2).stop_token_ids == frozenset({7, 9})
    True
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int | None = None
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", _token_set(self.stop_token_ids))
        check_int(self.n, "n", 1)
        check_int(self.top_k, "top_k", 0)
        if self.seed is not None:
            check_int(self.seed, "seed", None)
        if self.max_new_tokens is not None:
            check_int(self.max_new_tokens, "max_new_tokens", 1)
        check_bool(self.ignore_eos, "ignore_eos")
        if check_real(self.temperature, "temperature") < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy); got {self.temperature}")
        if not 0 < check_real(self.top_p, "top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")


_DEFAULT_SAMPLING = SamplingParams()


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt, its sampling parameters and a generation limit, plus its progress.

    Parameters
    ----------
    request_id : hashable
        Unique among live requests (the branches of ``n`` parallel samples are
        ``(request_id, k)`` for k >= 1).
    prompt_token_ids : list of int
        At least one token.
    max_new_tokens : int, optional
        Stop after this many generated tokens (>= 1).  Default ``sampling.max_new_tokens``.
    eos_token_id : int or iterable of int, optional
        The model's end-of-sequence id(s): generating any of them stops the request
        (unless ``sampling.ignore_eos``).
    sampling : SamplingParams, optional
    priority : int
        Lower is more urgent (vLLM's convention); equal priorities are first come first
        served.  Preemption takes the least urgent running request, newest first.

    Attributes
    ----------
    token_ids : list of int
        Prompt then generated tokens (the cache hashes blocks from this list).
    num_computed : int
        Leading tokens whose K/V is in the cache.
    num_preemptions : int
        Times the request was preempted and recomputed.
    stop_token_ids : frozenset of int
        Every token that stops it: ``sampling.stop_token_ids`` and the EOS ids.
    sample_index : int
        Which of the ``n`` parallel samples this is (0 for the request itself).
    parent : Request or None
        For a branch ``k >= 1``, the request it was forked from.
    branches : list of Request
        The request's ``n`` branches, itself first (only on the request that was added).
    num_cached_prompt_tokens : int
        Prompt tokens the prefix cache supplied at its first admission.
    finish_reason : str or None
        ``"length"``, ``"stop"`` or ``"abort"`` once done.

    Examples
    --------
    >>> from cupy_paged import Request
    >>> r = Request("a", [1, 2, 3], max_new_tokens=2, eos_token_id=[26, 7])
    >>> r.num_tokens, r.output_token_ids, r.status.value, sorted(r.stop_token_ids)
    (3, [], 'waiting', [7, 26])
    """

    request_id: object
    prompt_token_ids: list
    max_new_tokens: int | None = None
    eos_token_id: object = None
    sampling: SamplingParams = _DEFAULT_SAMPLING
    priority: int = 0
    num_preemptions: int = dataclasses.field(init=False, default=0)
    status: RequestStatus = dataclasses.field(init=False, default=RequestStatus.WAITING)
    sample_index: int = dataclasses.field(init=False, default=0)
    parent: object = dataclasses.field(init=False, default=None, repr=False)
    branches: list = dataclasses.field(init=False, repr=False)
    num_cached_prompt_tokens: int = dataclasses.field(init=False, default=0)
    finish_reason: str | None = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        if isinstance(self.prompt_token_ids, (str, bytes)) or not hasattr(self.prompt_token_ids, "__iter__"):
            raise TypeError(f"request {self.request_id!r}: prompt_token_ids must be a sequence of token ids; "
                            f"got {self.prompt_token_ids!r}")
        self.prompt_token_ids = _prompt_ids(self.prompt_token_ids, f"request {self.request_id!r}: prompt_token_ids")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must hold at least one token")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"request {self.request_id!r}: sampling must be a SamplingParams")
        wanted = self.sampling.max_new_tokens
        if self.max_new_tokens is None:
            self.max_new_tokens = wanted
        elif wanted is not None and int(wanted) != int(self.max_new_tokens):
            raise ValueError(f"request {self.request_id!r}: max_new_tokens {self.max_new_tokens} differs from "
                             f"sampling.max_new_tokens {wanted}")
        if self.max_new_tokens is None:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be >= 1; got None")
        self.max_new_tokens = check_int(self.max_new_tokens, f"request {self.request_id!r}: max_new_tokens", 1)
        self.priority = check_int(self.priority, f"request {self.request_id!r}: priority", None)
        eos = frozenset() if self.sampling.ignore_eos else _token_set(self.eos_token_id)
        self.stop_token_ids = self.sampling.stop_token_ids | eos
        self._token_ids = list(self.prompt_token_ids)
        self._run = None  # the running batch holding its newest tokens, while it decodes
        self.branches = [self]
        self._num_computed = 0
        self._cache = None  # the cache holding it while it runs: num_computed is the cache's then
        self._arrival = 0  # set by add_request: first come first served among equal priorities
        self._slot = -1  # its entry in the scheduler's running batch
        self._admitted = False  # admitted once: the prefix hit rate counts its prompt
        self._unforked = False  # its n parallel branches wait for its first sample
        self._pending_fork = False  # a branch waiting for its parent's first sample

    @property
    def num_computed(self) -> int:
        """Leading tokens whose K/V is in the cache."""
        cache = self._cache
        return self._num_computed if cache is None else cache.num_computed(self.request_id)

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        self._num_computed = int(value)

    @property
    def token_ids(self) -> list:
        """Prompt then generated tokens (the cache hashes blocks from this list)."""
        run = self._run
        if run is not None and run.num_pending[self._slot]:
            run.flush(self._slot)
        return self._token_ids

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

    @property
    def is_done(self) -> bool:
        """Finished or aborted."""
        return self.status is RequestStatus.FINISHED or self.status is RequestStatus.ABORTED

    def _branch(self, k: int) -> "Request":
        """Branch ``k`` of this request's parallel samples, not yet running."""
        child = Request((self.request_id, k), self.prompt_token_ids, self.max_new_tokens, None,
                        dataclasses.replace(self.sampling, n=1), self.priority)
        child.stop_token_ids = self.stop_token_ids
        child.sample_index, child.parent, child.branches = k, self, []
        child._arrival = self._arrival
        child._pending_fork = True
        return child


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
    max_model_len : int, optional
        Longest sequence (prompt plus new tokens) a request may reach; default what the
        cache (and the plan buffers) can hold for one sequence.

    Examples
    --------
    >>> from cupy_paged import SchedulerConfig
    >>> SchedulerConfig(max_batch_tokens=512, max_num_seqs=64).max_prefill_chunk
    512
    """

    max_batch_tokens: int = 2048
    max_num_seqs: int = 256
    max_prefill_chunk: int | None = None
    admission_margin: float = 0.02
    max_model_len: int | None = None

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_num_seqs", "max_prefill_chunk", "max_model_len"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, None)
        check_real(self.admission_margin, "admission_margin")
        if self.max_num_seqs < 1 or self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= max_batch_tokens "
                             f"({self.max_batch_tokens}): every running decode must fit one step")
        if self.max_prefill_chunk is None:
            self.max_prefill_chunk = self.max_batch_tokens
        if self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1; got {self.max_prefill_chunk}")
        if not 0.0 <= self.admission_margin < 1.0:
            raise ValueError(f"admission_margin must be in [0, 1); got {self.admission_margin}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2; got {self.max_model_len}")
