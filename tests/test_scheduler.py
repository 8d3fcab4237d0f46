"""Scheduler and step plan: budgets, chunking, preemption, the plan arrays, a soak, determinism."""
import dataclasses
import importlib.util
import json
import pathlib

import numpy as np
import pytest

import cupy_paged
from cupy_paged import flash_attn_varlen_func
from cupy_paged.runtime.buffers import PlanBuffers
from cupy_paged.runtime.scheduler import Scheduler
from cupy_paged.serving import scheduler as serving
from cupy_paged.serving.kv_cache import PagedAttentionCache
from cupy_paged.serving.scheduler import Request, RequestStatus, SamplingParams, SchedulerConfig


def make_scheduler(num_blocks=32, block_size=8, dtype="float32", kind=Scheduler, **config):
    cache = PagedAttentionCache(1, 1, 32, block_size=block_size, num_blocks=num_blocks, dtype=dtype, device="cpu")
    return kind(cache, SchedulerConfig(**config))


def check_plan(plan, cache):
    """The plan's arrays agree with each other and with the cache."""
    lens = plan.query_lens
    assert plan.cu_seqlens_q.tolist() == [0] + np.cumsum(lens).tolist()
    assert plan.cu_seqlens_k.tolist() == [0] + np.cumsum(plan.cache_seqlens + lens).tolist()
    assert plan.max_seqlen_q == lens.max() and plan.max_seqlen_k == (plan.cache_seqlens + lens).max()
    owner = np.repeat(np.arange(plan.batch_size), lens)
    starts = np.repeat(plan.cache_seqlens, lens)
    assert (plan.positions - starts == np.arange(plan.num_tokens) - np.repeat(plan.cu_seqlens_q[:-1], lens)).all()
    bs = cache.block_size
    blocks = plan.block_table[owner, plan.positions // bs]
    assert (blocks >= 0).all()
    assert (plan.slot_mapping == blocks * bs + plan.positions % bs).all()
    assert np.unique(plan.slot_mapping).size == plan.num_tokens, "two new tokens share a slot"
    ones = int(np.argmax(lens != 1)) if (lens != 1).any() else lens.size
    assert plan.path == ("decode" if ones == lens.size else "split" if ones else "varlen")
    assert plan.num_split == (ones if plan.path == "split" else 0)
    assert plan.tail_cu_seqlens_q.tolist() == (plan.cu_seqlens_q[plan.num_split:] - plan.num_split).tolist()
    for b, seq in enumerate(plan.seq_ids):
        assert plan.block_table[b, :cache.blocks(seq).size].tolist() == cache.blocks(seq).tolist()


def run_to_completion(scheduler, sample, max_steps=100_000, on_plan=None):
    """Drive the scheduler; ``sample(plan)`` returns the sampled tokens of a step."""
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        plan = scheduler.schedule()
        assert plan is not None, "requests are left but nothing could be scheduled"
        if on_plan is not None:
            on_plan(plan)
        finished.extend(scheduler.update(plan, sample(plan)))
    raise AssertionError("the scheduler did not finish")


# --------------------------------------------------------------------------- config and requests

@pytest.mark.parametrize("kwargs, match", [
    (dict(max_batch_tokens=8, max_num_seqs=16), "max_num_seqs"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_prefill_chunk=0), "max_prefill_chunk must be >= 1"),
    (dict(admission_margin=1.0), r"admission_margin must be in \[0, 1\)"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_bad_requests():
    with pytest.raises(ValueError, match="at least one token"):
        Request(0, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Request(0, [1], 0)
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(Request("a", [1], 4))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add_request(Request("a", [1], 4))
    with pytest.raises(ValueError, match="may grow to 33 tokens, more than the cache can hold"):
        scheduler.add_request(Request("b", list(range(30)), 3))


def test_update_must_follow_schedule():
    scheduler = make_scheduler()
    with pytest.raises(RuntimeError, match="needs a plan"):
        scheduler.update(None, [])
    scheduler.add_request(Request("a", [1, 2], 2))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="must take the previous step"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="must hold 1 tokens"):
        scheduler.update(plan, [1, 2])
    scheduler.update(plan, [3])
    assert scheduler.schedule().input_ids.tolist() == [3]


def test_update_takes_only_the_plan_schedule_returned():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], 2))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="not the one the last schedule"):
        scheduler.update(dataclasses.replace(plan), [3])  # equal, but not the same plan
    scheduler.update(plan, [3])


# --------------------------------------------------------------------------- one step

def test_decodes_go_first_then_prefills_under_the_budget():
    scheduler = make_scheduler(max_batch_tokens=12, max_num_seqs=4)
    for name in ("a", "b"):
        scheduler.add_request(Request(name, [1, 2, 3], 5))
    plan = scheduler.schedule()
    scheduler.update(plan, [7, 7])  # both prompts done: a and b now decode
    scheduler.add_request(Request("long", list(range(40)), 2))
    plan = scheduler.schedule()
    check_plan(plan, scheduler.cache)
    assert plan.seq_ids == ["a", "b", "long"] and plan.query_lens.tolist() == [1, 1, 10]
    assert plan.path == "split" and plan.num_split == 2 and plan.sample_mask.tolist() == [True, True, False]
    assert plan.logits_indices.tolist() == [0, 1]
    assert plan.input_ids.tolist() == [7, 7] + list(range(10))
    scheduler.update(plan, [8, 8])
    plan = scheduler.schedule()
    assert plan.query_lens.tolist() == [1, 1, 10] and plan.positions[2:].tolist() == list(range(10, 20))


def test_chunk_limit_and_path_selection():
    scheduler = make_scheduler(max_batch_tokens=64, max_num_seqs=4, max_prefill_chunk=16)
    scheduler.buffers = PlanBuffers(4, 64, scheduler.cache.max_blocks_per_seq)  # plans into fixed buffers
    scheduler.add_request(Request("p", list(range(33)), 1))
    lens = []
    run_to_completion(scheduler, lambda plan: np.zeros(len(plan.logits_indices), int),
                      on_plan=lambda plan: lens.append(plan.query_lens.tolist()))
    assert lens == [[16], [16], [1]]


def test_one_token_prompt_chunks_sample_only_at_the_end():
    """A prompt fed one token a step samples nothing until its last token is computed."""
    scheduler = make_scheduler(max_batch_tokens=64, max_num_seqs=4, max_prefill_chunk=1)
    scheduler.add_request(Request("p", [1, 2, 3, 4, 5], 2))
    samples = []
    finished = run_to_completion(scheduler, lambda plan: np.full(len(plan.logits_indices), 99),
                                 on_plan=lambda plan: samples.append(len(plan.logits_indices)))
    assert samples == [0, 0, 0, 0, 1, 1]
    assert finished[0].token_ids == [1, 2, 3, 4, 5, 99, 99]


def test_prefix_cache_shortens_a_second_prompt():
    scheduler = make_scheduler()
    prompt = list(range(30))
    scheduler.add_request(Request("a", prompt, 4))
    run_to_completion(scheduler, lambda plan: np.ones(len(plan.logits_indices), int))
    scheduler.add_request(Request("b", prompt + [5], 1))
    plan = scheduler.schedule()
    assert plan.cache_seqlens.tolist() == [24] and plan.query_lens.tolist() == [7]


def test_preempts_the_newest_and_recomputes_it():
    scheduler = make_scheduler(num_blocks=6, max_batch_tokens=64, max_num_seqs=4, admission_margin=0.0)
    scheduler.add_request(Request("old", list(range(15)), 12))  # grows to 4 blocks
    scheduler.add_request(Request("new", list(range(100, 115)), 12))
    finished = run_to_completion(scheduler, lambda plan: np.full(len(plan.logits_indices), 3))
    old, new = sorted(finished, key=lambda r: r.request_id == "new")
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    assert old.output_token_ids == new.output_token_ids == [3] * 12
    assert scheduler.num_preemptions == new.num_preemptions
    assert len(scheduler.cache) == 0 and scheduler.cache.num_free_blocks == 6


def test_a_prefill_preempting_a_decode_leaves_the_other_decodes_rows_and_sampling_right():
    scheduler = make_scheduler(num_blocks=4, max_batch_tokens=64, max_num_seqs=4, max_prefill_chunk=8,
                               admission_margin=0.0)
    scheduler.add_request(Request("a", list(range(8)), 3))
    scheduler.add_request(Request("p", list(range(100, 120)), 1))  # chunks of 8, 8 and 4
    scheduler.add_request(Request("d", list(range(200, 207)), 3))
    plan = scheduler.schedule()  # one block each, one left free
    assert plan.seq_ids == ["a", "p", "d"] and plan.sample_mask.tolist() == [True, False, True]
    scheduler.update(plan, [1, 1])
    plan = scheduler.schedule()  # a's decode takes the last block, so p's chunk preempts d, the newest
    check_plan(plan, scheduler.cache)
    assert plan.seq_ids == ["a", "p"] and plan.query_lens.tolist() == [1, 8]
    assert plan.sample_mask.tolist() == [True, False] and plan.logits_indices.tolist() == [0]
    assert scheduler.waiting[0].request_id == "d" and scheduler.num_preemptions == 1
    scheduler.update(plan, [2])
    finished = run_to_completion(scheduler, lambda plan: np.full(len(plan.logits_indices), 5),
                                 on_plan=lambda plan: check_plan(plan, scheduler.cache))
    outputs = {r.request_id: r.output_token_ids for r in finished}
    assert outputs == {"a": [1, 2, 5], "p": [5], "d": [1, 5, 5]}


def test_admission_keeps_a_margin_of_free_blocks():
    scheduler = make_scheduler(num_blocks=10, max_batch_tokens=128, max_num_seqs=8, admission_margin=0.2)  # margin: 2
    scheduler.add_request(Request("a", list(range(40)), 4))  # 5 blocks
    scheduler.add_request(Request("b", list(range(100, 124)), 4))  # 3 blocks would leave 2: allowed
    scheduler.add_request(Request("c", list(range(200, 208)), 4))  # 1 more would leave 1: waits
    plan = scheduler.schedule()
    assert plan.seq_ids == ["a", "b"] and scheduler.waiting[0].request_id == "c"
    assert scheduler.cache.num_free_blocks == 2


def test_eos_finishes_a_request_early():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], 10, eos_token_id=0))
    tokens = iter([5, 6, 0, 9])
    finished = run_to_completion(scheduler, lambda plan: [next(tokens)])
    assert finished[0].output_token_ids == [5, 6, 0] and finished[0].status is RequestStatus.FINISHED


def test_nothing_to_schedule_returns_none():
    assert make_scheduler().schedule() is None


def test_the_serving_scheduler_hands_out_plain_batches_the_runtime_plans():
    """The same requests through both schedulers: the serving one's batches are plain data, and
    the public one's plans are those batches built by build_plan."""
    assert cupy_paged.Scheduler is Scheduler and issubclass(Scheduler, serving.Scheduler)
    plain = make_scheduler(max_batch_tokens=12, max_num_seqs=4, kind=serving.Scheduler)
    planned = make_scheduler(max_batch_tokens=12, max_num_seqs=4)
    for s in (plain, planned):
        s.add_request(Request("a", [1, 2, 3], 3))
        s.add_request(Request("long", list(range(20)), 1))
    # a's prompt and long's first chunk; a decodes, long's last chunk; a decodes alone.
    for step in range(3):
        batch, plan = plain.schedule(), planned.schedule()
        assert isinstance(batch, serving.ScheduledBatch) and not hasattr(batch, "block_table")
        assert plan.seq_ids == batch.seq_ids and plan.query_lens.tolist() == batch.num_new_tokens.tolist()
        assert plan.input_ids.tolist() == batch.input_ids.tolist() and len(plan.logits_indices) == batch.num_sampled
        assert batch.rows.tolist() == plain.cache.rows(batch.seq_ids).tolist()
        assert (batch.num_decodes, batch.sample_mask is None) == [(0, False), (1, False), (1, True)][step]
        with pytest.raises(ValueError, match="batch is not the one"):
            plain.update(dataclasses.replace(batch), [])
        tokens = [5] * batch.num_sampled
        assert [r.request_id for r in plain.update(batch, tokens)] == \
               [r.request_id for r in planned.update(plan, tokens)]
    assert not plain.has_unfinished() and not planned.has_unfinished()
    with pytest.raises(RuntimeError, match="needs a batch"):
        plain.update(None, [])


# --------------------------------------------------------------------------- soak

def test_soak_ten_thousand_requests_through_a_small_cache():
    """Far more work than fits at once: preemption happens, yet every request finishes whole."""
    rng = np.random.default_rng(1)
    scheduler = make_scheduler(num_blocks=48, max_batch_tokens=96, max_num_seqs=16, max_prefill_chunk=40)
    stems = [rng.integers(0, 100, 40).tolist() for _ in range(8)]
    wanted = {}
    for i in range(10_000):
        prompt = stems[i % 8][:int(rng.integers(0, 24))] + rng.integers(0, 100, int(rng.integers(1, 24))).tolist()
        wanted[i] = int(rng.integers(1, 17))
        scheduler.add_request(Request(i, prompt, wanted[i]))
    budget = scheduler.config.max_batch_tokens
    checked = []

    def on_plan(plan):
        assert plan.num_tokens <= budget and plan.batch_size <= 16
        if len(checked) % 50 == 0:
            check_plan(plan, scheduler.cache)
        checked.append(plan.path)

    finished = run_to_completion(scheduler, lambda plan: rng.integers(0, 100, len(plan.logits_indices)),
                                 on_plan=on_plan)
    assert len(finished) == 10_000
    assert all(len(r.output_token_ids) == wanted[r.request_id] for r in finished)
    assert scheduler.num_preemptions > 0 and "decode" in checked and "varlen" in checked
    cache = scheduler.cache
    assert len(cache) == 0 and cache.num_free_blocks == cache.num_blocks and (cache.pool.ref_counts == 0).all()


# --------------------------------------------------------------------------- a tiny model

class TinyModel:
    """Fixed random embeddings, one attention layer through the public API, greedy argmax."""

    def __init__(self, vocab=64, heads=2, kv_heads=1, head_dim=32, max_positions=128, seed=0):
        rng = np.random.default_rng(seed)
        width = heads * head_dim
        self.shape = (heads, kv_heads, head_dim)
        self.embed = rng.standard_normal((vocab, width))
        self.position = rng.standard_normal((max_positions, width))
        self.wq, self.wk, self.wv = (rng.standard_normal((width, n * head_dim)) / np.sqrt(width)
                                     for n in (heads, kv_heads, kv_heads))
        self.wo = rng.standard_normal((width, vocab))

    def qkv(self, plan):
        heads, kv_heads, head_dim = self.shape
        x = self.embed[plan.input_ids] + self.position[plan.positions]
        return ((x @ self.wq).reshape(-1, heads, head_dim), (x @ self.wk).reshape(-1, kv_heads, head_dim),
                (x @ self.wv).reshape(-1, kv_heads, head_dim))

    def sample(self, out, plan):
        return (out.reshape(plan.num_tokens, -1)[plan.logits_indices] @ self.wo).argmax(-1)

    def step(self, plan, cache):
        out = plan.attention(*self.qkv(plan), *cache.layer(0))
        return self.sample(out, plan)


def generate(model, prompts, max_new_tokens, num_blocks, **config):
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=num_blocks, dtype="float64", device="cpu")
    scheduler = Scheduler(cache, SchedulerConfig(**config))
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(i, prompt, max_new_tokens))
    paths = set()
    finished = run_to_completion(scheduler, lambda plan: model.step(plan, cache),
                                 on_plan=lambda plan: paths.add(plan.path))
    return {r.request_id: r.output_token_ids for r in finished}, paths, scheduler.num_preemptions


def test_greedy_tokens_do_not_depend_on_the_batch():
    rng = np.random.default_rng(3)
    model = TinyModel()
    shared = rng.integers(0, 64, 16).tolist()
    prompts = [shared + rng.integers(0, 64, int(n)).tolist() for n in rng.integers(1, 20, 6)]
    alone = {}
    for i, prompt in enumerate(prompts):
        tokens, _, _ = generate(model, [prompt], 8, num_blocks=16, max_batch_tokens=64, max_num_seqs=1)
        alone[i] = tokens[0]
    together, paths, preemptions = generate(model, prompts, 8, num_blocks=14, max_batch_tokens=24,
                                            max_num_seqs=6, max_prefill_chunk=10)
    assert together == alone
    assert paths == {"decode", "split", "varlen"} and preemptions > 0  # chunked, mixed and recomputed
    assert len({tuple(t) for t in alone.values()}) > 1  # the stand-in is not constant


def test_manual_update_path_matches_the_paged_path():
    """The manual gather/scatter path: update() gathers K/V, then the non-paged varlen kernel."""
    model = TinyModel(seed=5)
    results = []
    for manual in (False, True):
        cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=16, dtype="float64", device="cpu")
        scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=16, max_num_seqs=4))
        for i, n in enumerate((21, 5, 12)):
            scheduler.add_request(Request(i, list(range(i, i + n)), 4))

        def step(plan):
            q, k, v = model.qkv(plan)
            if not manual:
                return model.sample(plan.attention(q, k, v, *cache.layer(0)), plan)
            keys, values = cache.update(k, v, 0, plan.read_index, plan.slot_mapping)
            out = flash_attn_varlen_func(q, keys, values, plan.cu_seqlens_q, plan.cu_seqlens_k,
                                         plan.max_seqlen_q, plan.max_seqlen_k, causal=True)
            return model.sample(out, plan)

        finished = run_to_completion(scheduler, step)
        results.append({r.request_id: r.output_token_ids for r in finished})
    assert results[0] == results[1]


# --------------------------------------------------------------------------- the host benchmark runs

def test_bench_host_writes_its_schema(tmp_path):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = bench.measure(64, repeats=3, rng=np.random.default_rng(0))
    names = ("plan", "plan_decode", "plan_ragged", "plan_ragged_decode", "plan_new_arrays", "schedule", "update",
             "step", "step_ragged")
    assert {c["name"] for c in cases} == {f"{n}_64" for n in names}
    assert all(c["metric"] == "median_us" and c["value"] > 0 and c["peers"] == {} for c in cases)
    json.dumps(cases)


# --------------------------------------------------------------------------- abort

def no_block_held(cache):
    """Every block free (cached free ones count as free): nothing leaked."""
    return len(cache) == 0 and cache.num_free_blocks == cache.num_blocks and (cache.pool.ref_counts == 0).all()


def test_abort_in_every_state_leaks_no_block():
    scheduler = make_scheduler(num_blocks=12, max_batch_tokens=16, max_num_seqs=3, max_prefill_chunk=8,
                               admission_margin=0.0)
    for name, n in (("dec", 9), ("chunked", 40), ("waits", 5), ("later", 3)):
        scheduler.add_request(Request(name, list(range(100 * len(name), 100 * len(name) + n)), 30))
    batch = scheduler.schedule()  # dec: 8 of 9; chunked: 8 of 40; waits: none (budget)
    scheduler.update(batch, [])
    batch = scheduler.schedule()
    scheduler.update(batch, [1] * len(batch.sample_requests))  # dec samples: it decodes from now on
    states = {r.request_id: (r.status, r.num_computed, r.num_tokens) for r in scheduler._live.values()}
    assert states["dec"][0] is RequestStatus.RUNNING and states["dec"][2] - states["dec"][1] == 1
    assert states["chunked"][0] is RequestStatus.RUNNING and 0 < states["chunked"][1] < 40
    assert scheduler.waiting and scheduler.waiting[-1].request_id == "later"
    cached_before = scheduler.cache.pool.num_cached
    # A decoding request, a request mid-prompt, a waiting one, an unknown id and a finished one.
    assert [r.request_id for r in scheduler.abort("dec")] == ["dec"]  # a string is one id, not its letters
    aborted = scheduler.abort(["dec", "chunked", "later", "nobody"])
    assert [r.request_id for r in aborted] == ["chunked", "later"]
    assert all(r.status is RequestStatus.ABORTED and r.finish_reason == "abort" for r in aborted)
    assert scheduler.abort(["dec"]) == []  # twice: nothing more to do
    assert scheduler.abort("dec") == [] and scheduler.abort(7) == []  # one id, not an iterable of ids
    assert scheduler.cache.pool.num_cached >= cached_before >= 1  # the full computed blocks stay cached
    assert [r.request_id for r in scheduler.running + scheduler.waiting] == ["waits"]
    finished = run_to_completion(scheduler, lambda b: [2] * len(b.sample_requests))
    assert [r.request_id for r in finished] == ["waits"] and no_block_held(scheduler.cache)
    assert scheduler.stats().num_aborted == 3 and scheduler.stats().num_finished == 1


def test_abort_a_preempted_request():
    scheduler = make_scheduler(num_blocks=6, max_batch_tokens=64, max_num_seqs=4, admission_margin=0.0)
    scheduler.add_request(Request("old", list(range(15)), 12))
    scheduler.add_request(Request("new", list(range(100, 115)), 12))
    while scheduler.num_preemptions == 0:
        batch = scheduler.schedule()
        scheduler.update(batch, [3] * len(batch.sample_requests))
    victim = scheduler.waiting[0]
    assert victim.request_id == "new" and victim.num_preemptions == 1 and scheduler.stats().num_preempted == 1
    assert scheduler.abort(["new"]) == [victim] and scheduler.stats().num_preempted == 0
    finished = run_to_completion(scheduler, lambda b: [3] * len(b.sample_requests))
    assert [r.request_id for r in finished] == ["old"] and no_block_held(scheduler.cache)


@pytest.mark.parametrize("kind", [serving.Scheduler, Scheduler])
@pytest.mark.parametrize("decode_only", [True, False])
def test_abort_between_schedule_and_update_drops_the_rows(kind, decode_only):
    scheduler = make_scheduler(kind=kind, max_batch_tokens=32, max_num_seqs=4)
    for name in "abc":
        scheduler.add_request(Request(name, [1, 2, 3], 5))
    step = scheduler.schedule()
    scheduler.update(step, [4, 5, 6])
    if not decode_only:
        scheduler.add_request(Request("d", list(range(10)), 5))
    step = scheduler.schedule()
    assert step.seq_ids[:3] == ["a", "b", "c"] and len(step.seq_ids) == (3 if decode_only else 4)
    scheduler.abort(["b"])
    samples = len(step.sample_requests)
    assert samples == (3 if decode_only else 4)  # the step keeps its rows: the model runs them
    scheduler.update(step, [7, 8, 9, 10][:samples])
    outputs = {r.request_id: r.output_token_ids for r in scheduler._live.values()}
    assert outputs["a"] == [4, 7] and outputs["c"] == [6, 9] and "b" not in outputs
    finished = run_to_completion(scheduler, lambda b: [0] * len(b.sample_requests))
    assert sorted(r.request_id for r in finished) == (["a", "c"] if decode_only else ["a", "c", "d"])
    assert no_block_held(scheduler.cache)


# --------------------------------------------------------------------------- stops, limits, priorities

def test_several_eos_ids_and_stop_ids_per_request():
    scheduler = make_scheduler(max_batch_tokens=32, max_num_seqs=8)
    scheduler.add_request(Request("eos7", [1, 2], 10, eos_token_id=[26, 7]))
    scheduler.add_request(Request("eos26", [1, 2], 10, eos_token_id=[26, 7]))
    scheduler.add_request(Request("stop5", [1, 2], 10, eos_token_id=26, sampling=SamplingParams(stop_token_ids={5, 6})))
    scheduler.add_request(Request("ignore", [1, 2], 4, eos_token_id=[26, 7], sampling=SamplingParams(ignore_eos=True)))
    script = {"eos7": [3, 7], "eos26": [26], "stop5": [3, 4, 6], "ignore": [7, 26, 7, 26]}
    finished = run_to_completion(scheduler, lambda b: [script[r.request_id][len(r.output_token_ids)]
                                                       for r in b.sample_requests])
    got = {r.request_id: (r.output_token_ids, r.finish_reason) for r in finished}
    assert got == {"eos7": ([3, 7], "stop"), "eos26": ([26], "stop"), "stop5": ([3, 4, 6], "stop"),
                   "ignore": ([7, 26, 7, 26], "length")}
    assert Request("x", [1], 2, eos_token_id=np.int64(3)).stop_token_ids == {3}


def test_max_new_tokens_from_the_sampling_params():
    assert Request("a", [1], sampling=SamplingParams(max_new_tokens=3)).max_new_tokens == 3
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Request("a", [1])
    with pytest.raises(ValueError, match="differs from sampling.max_new_tokens"):
        Request("a", [1], 2, sampling=SamplingParams(max_new_tokens=3))


def test_max_model_len_names_the_request():
    scheduler = make_scheduler(num_blocks=64, max_model_len=20)
    with pytest.raises(ValueError, match=r"request 'long' may grow to 21 tokens.*\(20: max_model_len\)"):
        scheduler.add_request(Request("long", list(range(17)), 4))
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=64, device="cpu", max_blocks_per_seq=2)
    narrow = Scheduler(cache)  # the block table is 2 blocks wide: 16 tokens
    assert narrow.max_model_len() == 16
    with pytest.raises(ValueError, match="request 7 may grow to 17 tokens"):
        narrow.add_request(Request(7, list(range(15)), 2))
    with pytest.raises(ValueError, match="buffers' block tables have 4 columns"):
        Scheduler(cache, buffers=PlanBuffers(4, 16, 4))


def test_priorities_order_admission_and_preemption():
    scheduler = make_scheduler(num_blocks=32, max_batch_tokens=64, max_num_seqs=1)
    scheduler.add_request(Request("low", [1, 2], 1, priority=5))
    scheduler.add_request(Request("high", [3, 4], 1, priority=-1))
    scheduler.add_request(Request("mid", [5, 6], 1))
    order = []
    run_to_completion(scheduler, lambda b: [0] * len(b.sample_requests), on_plan=lambda b: order.extend(b.seq_ids))
    assert order == ["high", "mid", "low"]
    # Preemption takes the least urgent request even when it is the older one.
    scheduler = make_scheduler(num_blocks=6, max_batch_tokens=64, max_num_seqs=4, admission_margin=0.0)
    scheduler.add_request(Request("old-low", list(range(15)), 12, priority=1))
    scheduler.add_request(Request("new-high", list(range(100, 115)), 12, priority=0))
    finished = run_to_completion(scheduler, lambda b: [3] * len(b.sample_requests))
    preempted = {r.request_id: r.num_preemptions for r in finished}
    assert preempted["old-low"] >= 1 and preempted["new-high"] == 0
    assert no_block_held(scheduler.cache)


# --------------------------------------------------------------------------- stats

def test_stats_agree_with_counts_made_here():
    scheduler = make_scheduler(num_blocks=16, max_batch_tokens=16, max_num_seqs=3, max_prefill_chunk=8,
                               kind=serving.Scheduler)
    prompt = list(range(30))
    requests = [Request("a", prompt, 3), Request("b", prompt + [7], 2), Request("c", list(range(50, 60)), 4)]
    scheduler.add_request(requests[0])
    added = requests[:1]
    prefill = decode = 0
    for step in range(1000):
        if step == 6:  # a is done: its full blocks are cached
            for r in requests[1:]:
                scheduler.add_request(r)
            added = requests
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        prefill += int(batch.num_new_tokens[batch.num_decodes:].sum())
        decode += batch.num_decodes
        stats = scheduler.stats()
        assert stats.num_running == sum(r.status is RequestStatus.RUNNING for r in added)
        assert stats.num_waiting == sum(r.status is RequestStatus.WAITING for r in added)
        assert stats.blocks_used == int((scheduler.cache.pool.ref_counts > 0).sum()) and stats.blocks_total == 16
        assert stats.cache_usage == stats.blocks_used / 16
        assert (stats.decode_tokens, stats.prefill_tokens) == (decode, prefill)
        if "b" in stats.cached_prompt_tokens_by_request:
            assert stats.cached_prompt_tokens_by_request["b"] == 24  # three full blocks of a's prompt
        scheduler.update(batch, [1] * len(batch.sample_requests))
    stats = scheduler.stats()
    assert stats.prompt_tokens == 30 + 31 + 10 and stats.cached_prompt_tokens == 24
    assert stats.prefix_hit_rate == pytest.approx(24 / 71) and requests[1].num_cached_prompt_tokens == 24
    assert decode == 2 + 1 + 3 and prefill == 30 + 7 + 10
    assert stats.num_finished == 3 and stats.num_running == stats.num_waiting == stats.blocks_used == 0
    assert dict(stats.cached_prompt_tokens_by_request) == {}


# --------------------------------------------------------------------------- rollback

def snapshot(scheduler):
    cache = scheduler.cache
    return ([(r.request_id, r.status, r.num_computed, list(r.token_ids)) for r in scheduler.running],
            [r.request_id for r in scheduler.waiting], cache.num_free_blocks,
            {s: (cache.num_slots(s), cache.num_computed(s), cache.blocks(s).tolist()) for s in cache.seq_ids()},
            {k: v for k, v in vars(scheduler.stats()).items() if k != "cached_prompt_tokens_by_request"})


def plan_key(plan):
    return (list(plan.seq_ids), plan.query_lens.tolist(), plan.input_ids.tolist(), plan.slot_mapping.tolist(),
            plan.block_table.tolist(), plan.logits_indices.tolist())


@pytest.mark.parametrize("decode_only", [True, False])
def test_rollback_leaves_everything_as_before_and_the_step_comes_again(decode_only):
    scheduler = make_scheduler(num_blocks=32, max_batch_tokens=24, max_num_seqs=4, max_prefill_chunk=8)
    for i in range(3):
        scheduler.add_request(Request(i, list(range(10 * i, 10 * i + 8)), 6))
    step = scheduler.schedule()
    scheduler.update(step, [1, 2, 3])  # all three decode at block boundaries (8 tokens + 1)
    if not decode_only:
        scheduler.add_request(Request("new", list(range(100, 120)), 3))
    before = snapshot(scheduler)
    plan = scheduler.schedule()
    first = plan_key(plan)
    assert (plan.path == "decode") == decode_only
    scheduler.rollback(plan)
    assert snapshot(scheduler) == before
    with pytest.raises(RuntimeError, match="needs a plan"):
        scheduler.rollback(plan)
    plan = scheduler.schedule()
    assert plan_key(plan) == first
    scheduler.update(plan, [5] * len(plan.sample_requests))
    run_to_completion(scheduler, lambda b: [0] * len(b.sample_requests))
    assert no_block_held(scheduler.cache)


def test_rollback_after_a_preemption_keeps_the_victim_preempted():
    scheduler = make_scheduler(num_blocks=6, max_batch_tokens=64, max_num_seqs=4, admission_margin=0.0)
    scheduler.add_request(Request("old", list(range(15)), 12))
    scheduler.add_request(Request("new", list(range(100, 115)), 12))
    while True:
        preemptions = scheduler.num_preemptions
        plan = scheduler.schedule()
        if scheduler.num_preemptions > preemptions:
            break
        scheduler.update(plan, [3] * len(plan.sample_requests))
    scheduler.rollback(plan)
    assert [r.request_id for r in scheduler.waiting] == ["new"] and scheduler.waiting[0].num_computed == 0
    finished = run_to_completion(scheduler, lambda b: [3] * len(b.sample_requests))
    assert all(r.output_token_ids == [3] * 12 for r in finished) and no_block_held(scheduler.cache)


# --------------------------------------------------------------------------- parallel samples

def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def dense_logits(model, tokens):
    """Logits at every position of ``tokens``, recomputed densely (no cache) by the CPU reference."""
    heads, kv_heads, head_dim = model.shape
    x = model.embed[tokens] + model.position[:len(tokens)]
    q, k, v = ((x @ w).reshape(len(tokens), h, head_dim) for w, h in ((model.wq, heads), (model.wk, kv_heads),
                                                                      (model.wv, kv_heads)))
    cu = np.array([0, len(tokens)], np.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, len(tokens), len(tokens), causal=True)
    return out.reshape(len(tokens), -1) @ model.wo


@pytest.mark.parametrize("seats", [8, 2])
def test_four_parallel_samples_share_the_prompt_and_match_a_dense_recomputation(seats):
    """n = 4: the prompt is computed once and forked; each branch samples with its own seed, and
    every logits row sampled matches a dense recomputation of that branch's tokens.  With 2 seats
    the branches that find none wait and are recomputed (the prefix cache gives the prompt back)."""
    model = TinyModel(seed=7)
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=40, dtype="float64", device="cpu")
    scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=16, max_num_seqs=seats, max_prefill_chunk=8))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, 21).tolist()
    scheduler.add_request(Request("p", prompt, 6, sampling=SamplingParams(n=4, seed=11)))
    scheduler.add_request(Request("q", rng.integers(0, 64, 5).tolist(), 6))
    fed = {}  # (family, position) -> times its K/V was computed
    seen = {}  # (branch id, position) -> the logits the paged step sampled from
    shared = []

    def step(plan):
        q, k, v = model.qkv(plan)
        out = plan.attention(q, k, v, *cache.layer(0))
        logits = out.reshape(plan.num_tokens, -1)[plan.logits_indices] @ model.wo
        for b, seq in enumerate(plan.seq_ids):
            family = seq[0] if isinstance(seq, tuple) else seq
            for position in plan.positions[plan.cu_seqlens_q[b]:plan.cu_seqlens_q[b + 1]].tolist():
                fed[family, position] = fed.get((family, position), 0) + 1
        if seats == 8 and ("p", 1) in plan.seq_ids and not shared:
            shared.append(cache.pool.ref_counts[cache.blocks("p")[:2]].tolist())
        rows = np.arange(len(plan.sample_requests)) if plan.sample_rows is None else plan.sample_rows
        tokens = []
        for request, row in zip(plan.sample_requests, rows.tolist()):
            position = int(plan.positions[plan.logits_indices[row]])
            seen[request.request_id, position] = logits[row]
            seed = [request.sampling.seed or 0, request.sample_index, position]
            tokens.append(int(np.random.default_rng(seed).choice(logits.shape[1], p=softmax(logits[row]))))
        return tokens

    finished = run_to_completion(scheduler, step)
    branches = {r.request_id: r for r in finished}
    assert sorted(branches, key=str) == sorted(["p", ("p", 1), ("p", 2), ("p", 3), "q"], key=str)
    assert {r.sample_index for r in branches["p"].branches} == {0, 1, 2, 3}
    assert len({tuple(r.output_token_ids) for r in branches["p"].branches}) > 1  # they sample apart
    for request in finished:
        dense = dense_logits(model, request.token_ids)
        positions = [p for (rid, p) in seen if rid == request.request_id]
        assert len(positions) == len(request.output_token_ids)
        for position in positions:
            np.testing.assert_allclose(seen[request.request_id, position], dense[position], rtol=1e-9, atol=1e-9)
    if seats == 8:
        assert all(fed["p", position] == 1 for position in range(len(prompt)))  # the prompt once
        assert all(fed["p", position] == 4 for position in range(len(prompt), len(prompt) + 5))
        assert shared == [[4, 4]]  # the full prompt blocks are shared by the four branches
    else:
        assert any(fed["p", position] > 1 for position in range(16, 21))  # a waiting branch recomputed
    assert no_block_held(cache)


def test_abort_a_request_of_parallel_samples_aborts_every_branch():
    scheduler = make_scheduler(num_blocks=32, max_batch_tokens=32, max_num_seqs=8, kind=serving.Scheduler)
    scheduler.add_request(Request("p", list(range(12)), 5, sampling=SamplingParams(n=3)))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add_request(Request(("p", 1), [1], 2))
    batch = scheduler.schedule()
    assert batch.num_sampled == 1 and batch.num_samples == 3 and batch.sample_rows.tolist() == [0, 0, 0]
    scheduler.update(batch, [1, 2, 3])
    assert sorted(map(str, scheduler.cache.seq_ids())) == sorted(map(str, ["p", ("p", 1), ("p", 2)]))
    assert [r.request_id for r in scheduler.abort([("p", 2)])] == [("p", 2)]
    assert scheduler.abort(("p", 2)) == [] and scheduler.abort(("p", 9)) == []  # one branch id each, not "p"
    assert [r.request_id for r in scheduler.abort(("p", 1))] == [("p", 1)]
    assert [r.sample_index for r in scheduler.abort(["p"])] == [0]
    assert not scheduler.has_unfinished() and no_block_held(scheduler.cache)


# --------------------------------------------------------------------------- the README's serving example

def test_readme_serving_example_runs():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "abort" in code and "eos_token_id=[26, 7]" in code and "n=4" in code and "stats()" in code
    exec(compile(code, "README.md (Serving)", "exec"), {"__name__": "readme_serving"})


@pytest.mark.parametrize("where", ["prompt", "sampled"])
@pytest.mark.parametrize("token", [2 ** 31, 2 ** 32 + 5, -5])
def test_token_ids_outside_int32_are_refused_not_wrapped(where, token):
    """The plan feeds token ids as int32: an id past 2**31 - 1 (or negative), in a prompt or a sampled
    token, is a ValueError naming it, not an id that wraps to another token."""
    scheduler = make_scheduler()
    if where == "prompt":
        with pytest.raises(ValueError, match="prompt_token_ids must be"):
            Request("r", [1, token, 2], 3)
        return
    scheduler.add_request(Request("r", [1, 2, 3], 3))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="^sampled_token_ids must be token ids in"):
        scheduler.update(plan, [token])
    assert scheduler.running[0].token_ids == [1, 2, 3]


def test_a_refused_parallel_request_can_be_queued_again():
    """add_request refused for a branch id that is live leaves the request as it was: once the
    clash is gone the same object queues with all its branches, and serving ends."""
    scheduler = make_scheduler()
    scheduler.add_request(Request((5, 1), [9, 9], 1))  # a user id that is also branch 1's of request 5
    request = Request(5, [1, 2, 3], 2, sampling=SamplingParams(n=2))
    with pytest.raises(ValueError, match="branch id"):
        scheduler.add_request(request)
    assert len(request.branches) == 1
    scheduler.abort((5, 1))
    scheduler.add_request(request)
    for _ in range(20):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        if plan is not None:
            scheduler.update(plan, [7] * len(plan.sample_requests))
    assert not scheduler.has_unfinished()
    assert [b.output_token_ids for b in request.branches] == [[7, 7], [7, 7]]


@pytest.mark.parametrize("field, value, error", [("n", 1.5, TypeError), ("n", "2", TypeError), ("n", 0, ValueError),
                                                 ("top_k", 1.5, TypeError), ("temperature", "hot", TypeError),
                                                 ("temperature", -0.1, ValueError), ("top_p", 0.0, ValueError),
                                                 ("ignore_eos", 1, TypeError), ("max_new_tokens", 0, ValueError)])
def test_sampling_params_refuse_what_is_no_setting(field, value, error):
    """A float where an int goes (n=1.5 truncated, n="2" failing later at add_request) or a value out
    of range: refused where the SamplingParams is made, naming the field."""
    with pytest.raises(error, match=f"^{field} must"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("call", ["grow", "shrink", "mark_computed", "build_plan"])
@pytest.mark.parametrize("counts, error", [([1.5], TypeError), ([1, 2, 3], ValueError)])
def test_per_sequence_counts_are_ints_one_per_sequence(call, counts, error):
    """Counts of tokens per sequence: a float is refused, not truncated, and a list of another length
    is refused naming the argument (not a NumPy broadcast error); nothing changes."""
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, dtype="float32", device="cpu")
    cache.allocate("a", list(range(5)))
    if call == "mark_computed":
        counts = [[2.5], [1, 2]][error is ValueError]
    before = (cache.num_slots("a"), cache.num_computed("a"))
    name = dict(grow="num_new_tokens", shrink="num_tokens", mark_computed="num_computed", build_plan="query_lens")
    with pytest.raises(error, match=f"^{name[call]} must"):
        if call == "build_plan":
            cupy_paged.build_plan(cache, ["a"], counts)
        else:
            getattr(cache, call)(["a"], counts)
    assert (cache.num_slots("a"), cache.num_computed("a")) == before
