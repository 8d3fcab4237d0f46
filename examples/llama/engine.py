"""The serving loop: requests in, generated tokens out, one scheduled step at a time.

Each step ``cupy_paged.Scheduler.schedule()`` picks the running decodes, then prompt chunks
under the token budget (admitting waiting requests through the prefix cache, preempting the
newest request when blocks run out) and returns one plan; the model runs it, the rows the plan
names are sampled, and ``update()`` takes the tokens back.  All the batching policy is the
scheduler's and the cache's: the engine only runs the model and keeps statistics.

On the GPU every step runs on one non-blocking CUDA stream (a capture needs one), plans are
built into fixed :class:`cupy_paged.PlanBuffers`, and with ``cuda_graphs=True`` decode steps
replay captured graphs (:mod:`llama.cuda_graphs`).

Asynchronous scheduling (on by default on the GPU): a step is launched and its tokens are read
only after the next decode step has been scheduled and launched behind it
(``Scheduler.schedule_ahead``), so the host's scheduling, plan building and update overlap the
device's step; the next step takes its input tokens from the previous step's samples on the
device.  Sampling leaves nothing to wait for: the uniforms of stochastic rows are drawn on the
host from each request's generator, the rest runs on the device.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import zlib

import numpy as np

import cupy_paged

from .parallel import plan_from_message, plan_message
from .sampling import SamplingParams, sample_tokens
from .timing import Timer

STEP_KINDS = ("decode", "mixed", "prefill")


def _plan_rows(plan) -> int:
    """The sequences a plan runs: a decode graph's plan (built by ``DecodeGraphs.plan``) is padded
    to its graph's batch, whose real rows ``graph_rows`` names."""
    rows = getattr(plan, "graph_rows", None)
    return plan.batch_size if rows is None else rows


def _step_kind(plan, rows: int) -> str:
    """One of :data:`STEP_KINDS`: ``decode`` when every one of the ``rows`` sequences feeds one
    token, ``prefill`` when none does, else ``mixed``."""
    decodes = plan.num_decodes
    return "decode" if decodes == rows else "prefill" if decodes == 0 else "mixed"


@dataclasses.dataclass
class GenerationRequest:
    """One prompt to serve.

    Parameters
    ----------
    request_id : hashable
    prompt : list of int
    max_new_tokens : int
    sampling : SamplingParams
    eos_token_id : int, optional
        Stop after generating it (default: run to ``max_new_tokens``).
    """

    request_id: object
    prompt: list
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_id: int | None = None


@dataclasses.dataclass
class EngineStats:
    """What a run did.

    ``seconds`` buckets: ``attention`` (the plan's attention calls), ``other`` (the rest of the
    model and sampling in eager steps), ``graph`` (decode graph replays and their sampling), and
    ``host`` (each step's wall time less its launches and the waits for tokens: scheduling, plan
    building and upload, update).  On the GPU the first three are stream time between CUDA
    events, which includes any time the GPU waited for the host to enqueue work; with
    asynchronous scheduling the host's share runs while the device works, so the buckets may add
    up to more than the wall time.
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Tokens the model ran in rows of more than one token: prompt chunks and recomputation.  As in
    # the scheduler, a row that feeds one token is a decode, so a prompt whose last chunk holds one
    # token counts that token as a decode and its step as a decode (or mixed) step.
    computed_prompt_tokens: int = 0
    steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kernel_paths: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    num_blocks: int = 0
    graph_replays: int = 0
    wall_seconds: float = 0.0
    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of the tokens of admitted requests found in the prefix cache."""
        return self.prefix_hit_tokens / max(1, self.prefix_queried_tokens)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall second."""
        return self.generated_tokens / max(self.wall_seconds, 1e-9)


@dataclasses.dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    plan: object
    tokens: object        # [samples] int64 on the model's device
    landing: np.ndarray   # where they arrive on the host (pinned memory on the GPU)
    done: object          # the CUDA event after their transfer; None on the CPU
    timer: Timer          # the step's spans


class Engine:
    """Serves :class:`GenerationRequest` s with a :class:`llama.model.LlamaModel`.

    Parameters
    ----------
    model : LlamaModel
        Its array module decides the device: NumPy runs the CPU reference backend, CuPy the GPU.
    num_blocks, memory_fraction : optional
        Cache size: a block count, or a fraction of the device's free memory.  One of them.
    block_size : int
        Tokens per cache block.
    max_batch_tokens, max_num_seqs, max_prefill_chunk :
        The scheduler's step limits (``cupy_paged.SchedulerConfig``).
    max_model_len : int, optional
        Longest prompt plus generation (default the model's rotary table length); sizes the
        block tables.
    enable_prefix_caching : bool
    cuda_graphs : bool
        Replay decode steps as CUDA graphs (CuPy only).
    group : llama.parallel.SocketGroup or NcclGroup, optional
        Tensor parallelism: ``model`` holds this rank's shard (``llama.parallel.shard``) and
        all-reduces through ``group``; rank 0 schedules, samples and broadcasts each step's plan,
        the other ranks run :meth:`follow`.
    ragged : bool
        Plans for the ragged launch (``cupy_paged.Scheduler(num_heads=...)``): one attention
        launch per layer for decode and mixed steps; False keeps the decode / varlen kernels.
    graph_attention : {"decode", "ragged"}
        The decode graphs' attention: the decode kernel (the default; in the served benchmark it
        was the faster) or the ragged launch over a work list of fixed capacity.
    graph_sizes : list of int, optional
        The padded decode batch sizes to capture (default ``llama.cuda_graphs.default_sizes``).
    tune_products : bool
        Before capturing a decode graph, time cuBLAS's candidate kernels for its products at that
        batch size and capture the fastest (``LlamaModel.tune_products``; each shape is timed
        once a process).  Off by default: the choice follows a timing, so it can differ from
        one process to the next (and with it the products' rounding), and on the H200 it saved
        about 1% of a decode step at 64 requests and nothing at 256 (benchmarks/NOTES_e2e.md,
        section 14), for 3-4 s more of warm-up.
    seed : int
        Seeds the generators of requests that give no seed of their own.
    async_scheduling : bool, optional
        Schedule and launch each decode step before reading the previous step's tokens
        (default: on the GPU without tensor parallelism).  :meth:`step` then returns the
        requests that finished in the step before the one it launched.
    """

    def __init__(self, model, *, num_blocks=None, memory_fraction=None, block_size=16, max_batch_tokens=2048,
                 max_num_seqs=64, max_prefill_chunk=None, max_model_len=None, enable_prefix_caching=True,
                 cuda_graphs=False, graph_sizes=None, seed=0, ragged=True, group=None, async_scheduling=None,
                 graph_attention="decode", tune_products=False):
        c = model.config
        self.model, self.gpu, self.seed = model, model.xp is not np, seed
        self.group = group if group is not None and group.world_size > 1 else None
        self.async_scheduling = (self.gpu and self.group is None) if async_scheduling is None else bool(async_scheduling)
        if self.group is not None:
            if cuda_graphs:
                raise ValueError("cuda_graphs with tensor parallelism is not offered yet")
            if self.async_scheduling:
                raise ValueError("async_scheduling with tensor parallelism is not offered yet")
            model.all_reduce = self.group.all_reduce
            if self.group.rank > 0:  # the same blocks as rank 0's cache
                num_blocks, memory_fraction = self.group.broadcast(), None
        max_model_len = min(max_model_len or model.max_positions, model.max_positions)
        self.cache = cupy_paged.PagedAttentionCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size=block_size, num_blocks=num_blocks,
            memory_fraction=memory_fraction, dtype=model.dtype, device="cuda" if self.gpu else "cpu",
            max_blocks_per_seq=-(-max_model_len // block_size), enable_prefix_caching=enable_prefix_caching)
        if self.group is not None and self.group.rank == 0:
            self.group.broadcast(self.cache.num_blocks)
        config = cupy_paged.SchedulerConfig(max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                                            max_prefill_chunk=max_prefill_chunk)
        heads = c.num_attention_heads
        extra = {"num_heads": heads} if ragged else {}
        self.stream = self.graphs = None
        if self.gpu:
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
            # Fixed plan buffers: one pinned upload a step, unchanged block-table rows not rewritten.
            extra["buffers"] = cupy_paged.PlanBuffers(max_batch=max_num_seqs, max_tokens=max_batch_tokens,
                                                      max_blocks_per_seq=self.cache.max_blocks_per_seq,
                                                      device="cuda",
                                                      query_group=heads // c.num_key_value_heads if ragged else None)
            if cuda_graphs:
                from .cuda_graphs import DecodeGraphs

                if graph_attention not in ("decode", "ragged"):
                    raise ValueError(f"graph_attention must be 'decode' or 'ragged'; got {graph_attention!r}")
                self.graphs = DecodeGraphs(model, self.cache, self.stream, max_num_seqs, graph_sizes,
                                           ragged=graph_attention == "ragged", tune_products=tune_products)
        elif cuda_graphs:
            raise ValueError("cuda_graphs needs a model on CuPy arrays")
        if self.graphs is not None:  # decode steps are built once, padded into the graphs' buffers
            extra["decode_planner"] = lambda batch: self.graphs.plan(batch.seq_ids, batch.input_ids, batch.rows)
        self.scheduler = cupy_paged.Scheduler(self.cache, config, **extra)
        self._seconds: collections.Counter = collections.Counter()  # the buckets of EngineStats.seconds
        # Two of each: a step in flight and the one launched behind it.
        self._timers = [Timer(gpu=self.gpu, seconds=self._seconds) for _ in range(2)]
        self._landing = []  # the sampled tokens on the host, pinned (on the CPU the tokens themselves)
        if self.gpu:
            import cupy

            self._landing = [np.frombuffer(cupy.cuda.alloc_pinned_memory(8 * max_num_seqs), np.int64)
                             for _ in range(2)]
        self._flip = 0
        self._inflight: _InFlight | None = None  # launched, tokens not read yet
        self.stats = EngineStats(num_blocks=self.cache.num_blocks)
        self._live: dict = {}        # request id -> (scheduler Request, GenerationRequest, generator)
        self._stats_before = self.scheduler.stats()  # the scheduler's totals when the statistics were reset

    def add_request(self, request: GenerationRequest) -> None:
        """Queue one request (``ValueError`` when it could never fit the cache or the model)."""
        tracked = cupy_paged.Request(request.request_id, list(request.prompt), request.max_new_tokens,
                                     eos_token_id=request.eos_token_id)
        if tracked.max_tokens > self.model.max_positions:
            raise ValueError(f"request {request.request_id!r} may reach {tracked.max_tokens} tokens, past the "
                             f"model's {self.model.max_positions} positions")
        vocab = self.model.config.vocab_size
        if max(tracked.prompt_token_ids) >= vocab:  # Request checked they are ints >= 0, at least one
            raise ValueError(f"request {request.request_id!r} has prompt token ids outside [0, {vocab})")
        self.scheduler.add_request(tracked)
        self._live[request.request_id] = (tracked, request, self._generator(request))

    def _generator(self, request: GenerationRequest) -> np.random.Generator:
        """The request's own generator: its seed, else one derived from the engine's seed and its id
        (crc32 of the id's repr, the same in every process, unlike ``hash`` of a string)."""
        if request.sampling.seed is not None:
            return np.random.default_rng(request.sampling.seed)
        rid = request.request_id
        key = rid % 2**63 if isinstance(rid, int) else zlib.crc32(repr(rid).encode())
        return np.random.default_rng([self.seed, key])

    @property
    def in_flight_kind(self) -> str | None:
        """The kind (one of :data:`STEP_KINDS`, as ``stats.steps`` counts it) of the launched step
        whose tokens are not read yet; None when there is none.

        With asynchronous scheduling the next :meth:`step` launches a step behind this one and then
        waits for this one's tokens, so that call's wall time includes whatever device time this
        step has left: the call that launches the first decode step after a prefill or mixed step
        also waits for that step.  Without asynchronous scheduling it is None between calls (each
        call waits for the step it launched itself).
        """
        record = self._inflight
        return None if record is None else _step_kind(record.plan, _plan_rows(record.plan))

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, or a launched step's tokens are not read yet."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list:
        """Run one scheduled step; returns the scheduler ``Request`` s that finished.

        With asynchronous scheduling the step is launched behind the one in flight, whose tokens
        are then read: the requests returned finished in that earlier step.
        """
        start = time.perf_counter()
        finished, busy = [], 0.0
        with self.stream if self.gpu else contextlib.nullcontext():
            previous, self._inflight = self._inflight, None
            if previous is not None:
                try:  # a failure here leaves the step in flight pending, read at the next step
                    ahead = self.scheduler.schedule_ahead()
                    if ahead is not None:
                        self._inflight, busy = self._launch(ahead, previous)
                except BaseException:
                    self._inflight = previous
                    raise
                finished, waited = self._settle(previous)
                busy += waited
            if self._inflight is None and self.scheduler.has_unfinished():
                plan = self.scheduler.schedule()
                if plan is None:
                    raise RuntimeError("the scheduler could schedule nothing while requests are unfinished")
                if self.group is not None:
                    self.group.broadcast(plan_message(plan))
                record, launched = self._launch(plan, None)
                busy += launched
                if self.async_scheduling:
                    self._inflight = record
                else:
                    more, waited = self._settle(record)
                    finished, busy = finished + more, busy + waited
        self._seconds["host"] += time.perf_counter() - start - busy
        return finished

    def _launch(self, plan, previous) -> tuple["_InFlight", float]:
        """Enqueue the model and the sampling of ``plan`` (the inputs of a step scheduled ahead
        from ``previous``' tokens on the device) and the tokens' transfer to the host; returns
        the step in flight and the host seconds spent.  A failure rolls the step back."""
        start = time.perf_counter()
        timer = self._timers[self._flip]
        try:
            graphed = getattr(plan, "graph_rows", None) is not None  # built by self.graphs.plan
            rows = _plan_rows(plan)
            sampling = [self._live[r.request_id] for r in plan.sample_requests]
            params, generators = [g.sampling for _, g, _ in sampling], [rng for _, _, rng in sampling]
            if plan.input_ids_pending:  # the previous step's samples, moved on the device
                if previous is None or previous.tokens.shape != (rows,):
                    raise RuntimeError("a step scheduled ahead needs the previous step's tokens, one per row")
                plan.input_ids[:rows] = previous.tokens
            if graphed:
                with timer.span("graph"):
                    logits, greedy = self.graphs.replay(plan)
                    tokens = sample_tokens(logits, params, generators, greedy)
            else:
                with timer.span("model"):
                    logits = self.model.forward(plan, self.cache, timer)
                    tokens = sample_tokens(logits, params, generators)
        except BaseException:  # the forward pass failed: the step is undone and comes again next time
            timer.discard()
            self.scheduler.rollback(plan)
            raise
        landing, done = tokens, None
        if self.gpu:
            landing = self._landing[self._flip][:tokens.size]
            tokens.get(stream=self.stream, out=landing, blocking=False)
            done = self.stream.record()
        self._flip ^= 1
        self._count_step(plan, rows)
        return _InFlight(plan, tokens, landing, done, timer), time.perf_counter() - start

    def _settle(self, record: "_InFlight") -> tuple[list, float]:
        """Wait for a launched step's tokens and give them to the scheduler; returns the
        requests that finished and the seconds waited."""
        start = time.perf_counter()
        if record.done is not None:
            record.done.synchronize()
        record.timer.collect()
        waited = time.perf_counter() - start
        finished = self.scheduler.update(record.plan, record.landing)
        for request in finished:
            del self._live[request.request_id]
            self.stats.requests += 1
            self.stats.prompt_tokens += len(request.prompt_token_ids)
            self.stats.generated_tokens += len(request.output_token_ids)
        return finished, waited

    def follow(self) -> None:
        """Rank > 0 of a tensor-parallel engine: run every step rank 0 broadcasts, until
        :meth:`stop_followers`."""
        if self.group is None or self.group.rank == 0:
            raise RuntimeError("follow() is for the ranks after rank 0 of a tensor-parallel engine")
        with self.stream if self.gpu else contextlib.nullcontext():
            while (message := self.group.broadcast()) is not None:
                self.model.forward(plan_from_message(message, self.model.xp), self.cache)
                if self.gpu:  # the step's all-reduces ran; the next message may reuse nothing
                    self.stream.synchronize()

    def stop_followers(self) -> None:
        """Rank 0: tell the other ranks that no step follows."""
        if self.group is not None and self.group.rank == 0:
            self.group.broadcast(None)

    def warm_up(self) -> None:
        """Compile every kernel a step uses (prefill, decode, sampling) and capture the decode
        graphs, then forget the statistics: a timed run after it measures serving alone."""
        block = self.cache.block_size
        prompts = [[(7 * i + 3) % self.model.config.vocab_size for i in range(2 * block + 3)], [1, 2, 3]]
        self.run([GenerationRequest(("warm-up", 0), prompts[0], 3),
                  GenerationRequest(("warm-up", 1), prompts[1], 3, SamplingParams(1.0, 0.9, 5, seed=0))])
        if self.graphs is not None:
            with self.stream:
                self.graphs.capture_all()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the statistics so far (after a warm-up): the next run's figures start from zero."""
        if self.graphs is not None:
            self.graphs.replays = 0
        self.stats = EngineStats(num_blocks=self.cache.num_blocks)
        self._stats_before = self.scheduler.stats()
        self._seconds.clear()

    def _count_step(self, plan, rows: int) -> None:
        """Step kind, kernel path, prefix-cache hits and cache use of the step just scheduled
        (``rows``: its sequences, the padding of a graph's plan left out)."""
        stats = self.stats
        stats.steps[_step_kind(plan, rows)] += 1
        stats.kernel_paths[plan.path] += 1
        now, before = self.scheduler.stats(), self._stats_before  # O(1): the scheduler keeps the totals
        stats.computed_prompt_tokens = now.prefill_tokens - before.prefill_tokens
        stats.prefix_queried_tokens = now.prompt_tokens - before.prompt_tokens
        stats.prefix_hit_tokens = now.cached_prompt_tokens - before.cached_prompt_tokens
        stats.peak_blocks = max(stats.peak_blocks, now.blocks_used)
        stats.preemptions = now.num_preemptions - before.num_preemptions

    def run(self, requests, on_finish=None) -> dict:
        """Serve ``requests`` to the end.

        Parameters
        ----------
        requests : iterable of GenerationRequest
        on_finish : callable, optional
            Called with each finished scheduler ``Request`` (e.g. a progress bar's update).

        Returns
        -------
        dict
            request id -> list of generated token ids.
        """
        for request in requests:
            self.add_request(request)
        outputs = {}
        start = time.perf_counter()
        while self.has_unfinished():
            for request in self.step():
                outputs[request.request_id] = request.output_token_ids
                if on_finish is not None:
                    on_finish(request)
        self.stats.wall_seconds += time.perf_counter() - start
        self.stats.graph_replays = self.graphs.replays if self.graphs is not None else 0
        seconds = self._seconds
        model_time = seconds["model"] - seconds["attention"]
        self.stats.seconds.update(attention=seconds["attention"], other=max(0.0, model_time),
                                  graph=seconds["graph"], host=seconds["host"])
        seconds.clear()
        return outputs
