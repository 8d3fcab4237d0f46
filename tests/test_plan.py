"""The step plan: index arrays from the cache, fixed buffers for CUDA graphs, and
``StepPlan.attention`` per layer (CPU, and on a GPU from a host or a device plan)."""
import numpy as np
import pytest

from cupy_paged.runtime.buffers import PlanBuffers
from cupy_paged.runtime.plan import build_plan
from cupy_paged.serving.kv_cache import PagedAttentionCache


def test_plan_buffers_track_changed_rows_and_pad():
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=16, dtype="float32", device="cpu",
                                max_blocks_per_seq=6)
    buffers = PlanBuffers(max_batch=4, max_tokens=8, max_blocks_per_seq=6)
    for seq, n in (("a", 5), ("b", 8)):
        cache.allocate(seq, list(range(30)), num_new_tokens=n)
        cache.mark_computed([seq], [n])
    steps = [("grow", ["a", "b"]), ("fork", None), ("grow", ["a", "b", "a2"]), ("free", "b"), ("grow", ["a", "a2"])]
    for action, arg in steps:
        if action == "fork":
            cache.fork("a", "a2")  # shares a's partial block: the next grow copies it
            continue
        if action == "free":
            cache.free(arg)
            continue
        cache.grow(arg, 1)
        fresh = build_plan(cache, arg, 1)
        fixed = build_plan(cache, arg, 1, buffers=buffers, batch_size=4, num_tokens=8)
        width = fresh.block_table.shape[1]
        assert np.array_equal(fixed.block_table[:len(arg), :width], fresh.block_table)
        assert (fixed.block_table[:len(arg), width:] == -1).all() and (fixed.block_table[len(arg):] == -1).all()
        assert np.array_equal(fixed.slot_mapping[:len(arg)], fresh.slot_mapping)
        assert (fixed.slot_mapping[len(arg):] == -1).all() and (fixed.positions[len(arg):] == 0).all()
        assert fixed.cu_seqlens_q.tolist() == fresh.cu_seqlens_q.tolist() + [len(arg)] * (4 - len(arg))
        assert fixed.cache_seqlens[len(arg):].tolist() == [0] * (4 - len(arg))
        assert fixed.batch_size == 4 and fixed.sample_mask.tolist() == [True] * len(arg) + [False] * (4 - len(arg))
        # 8 padded tokens on 4 rows are no longer one token per row: the varlen path runs it.
        assert fresh.path == "decode" and fixed.path == "varlen"
        assert build_plan(cache, arg, 1, buffers=buffers, batch_size=4, num_tokens=4).path == "decode"
        x = np.ones((8, 1, 32), np.float32)
        assert fixed.attention(x, x, x, *cache.layer(0)).shape == (8, 1, 32)
        cache.mark_computed(arg, [cache.num_slots(s) for s in arg])


def test_plan_rejects_unreserved_tokens_and_oversized_padding():
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
    cache.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match=r"query_lens\[0\] = 4 must be >= 1 and fit the 3 slots"):
        build_plan(cache, ["a"], [4])
    with pytest.raises(ValueError, match="must fit the buffers"):
        build_plan(cache, ["a"], [3], buffers=PlanBuffers(1, 2, cache.max_blocks_per_seq))
    with pytest.raises(ValueError, match="pass buffers too"):
        build_plan(cache, ["a"], [3], batch_size=2)



# --------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("uploaded", [False, True])
def test_cuda_plan_attention_from_host_or_device_plan(uploaded):
    """``StepPlan.attention`` on CUDA caches, from a plan built without buffers (``build_plan``
    uploads its indices in one transfer) or into PlanBuffers; both equal the CPU reference."""
    import cupy

    rng = np.random.default_rng(7)
    layers, kv_heads, heads, dim = 2, 2, 4, 64
    cache = PagedAttentionCache(layers, kv_heads, dim, block_size=16, num_blocks=16, dtype="float16",
                                device="cuda")
    host = PagedAttentionCache(layers, kv_heads, dim, block_size=16, num_blocks=16, dtype="float16",
                               device="cpu")
    for c in (cache, host):
        c.allocate("a", list(range(40)))
        c.allocate("b", list(range(7)))
    buffers = PlanBuffers(4, 64, cache.max_blocks_per_seq, device="cuda") if uploaded else None
    plan = build_plan(cache, ["a", "b"], [40, 7], buffers=buffers)
    host_plan = build_plan(host, ["a", "b"], [40, 7])
    assert isinstance(plan.block_table, cupy.ndarray)  # the plan lives where the cache lives
    for layer in range(layers):
        q, k, v = (rng.standard_normal((47, n, dim)).astype(np.float16) for n in (heads, kv_heads, kv_heads))
        got = plan.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), *cache.layer(layer))
        want = host_plan.attention(q, k, v, *host.layer(layer))
        np.testing.assert_allclose(got.get().astype(np.float32), want.astype(np.float32), rtol=5e-3, atol=5e-3)
        np.testing.assert_array_equal(cache.layer(layer)[0].get(), host.layer(layer)[0])  # the same writes
    if not uploaded:  # one device buffer holds every index array
        assert plan.block_table.data.mem is plan.positions.data.mem is plan.cu_seqlens_k.data.mem


def _two_sequence_plans(path: str, layers: int, heads: int, kv_heads: int, dim: int):
    """``(cache, host, plan, host_plan, lens)``: a CUDA cache and its CPU twin holding sequences of 40
    and 7 tokens, and a step on ``path`` over both (one new token each, or the whole prompts on
    ``"varlen"``) planned on each side."""
    cache, host = (PagedAttentionCache(layers, kv_heads, dim, block_size=16, num_blocks=16, dtype="float16",
                                       device=device) for device in ("cuda", "cpu"))
    lens = [40, 7] if path == "varlen" else [1, 1]
    for c in (cache, host):
        c.allocate("a", list(range(40)))
        c.allocate("b", list(range(7)))
        if path != "varlen":
            c.mark_computed(["a", "b"], [39, 6])
    plan = build_plan(cache, ["a", "b"], lens, **(dict(num_heads=heads, path="ragged") if path == "ragged" else {}))
    assert plan.path == path
    return cache, host, plan, build_plan(host, ["a", "b"], lens), lens


def _cpu_step(path: str):
    """A CPU cache with "a" (5 tokens cached, one new) and, except on the decode path, "b" (a
    3-token prompt), and the plan of that step forced onto ``path``."""
    cache = PagedAttentionCache(1, 2, 32, block_size=8, num_blocks=8, dtype="float32", device="cpu")
    cache.allocate("a", list(range(6)))
    cache.mark_computed(["a"], [5])
    seqs, lens = (["a"], [1]) if path == "decode" else (["a", "b"], [1, 3])
    if path != "decode":
        cache.allocate("b", list(range(3)))
    return cache, build_plan(cache, seqs, lens, num_heads=4 if path == "ragged" else None, path=path), sum(lens)


@pytest.mark.parametrize("caches", ["numpy", "torch"])
@pytest.mark.parametrize("path", ["decode", "varlen", "split", "ragged"])
def test_torch_cpu_layers_run_the_cpu_backend_on_every_path(path, caches):
    """q, k, v as torch CPU tensors (beside NumPy caches or torch views of them): every path of the
    plan runs the CPU backend and returns a torch tensor (``out`` itself where given), equal to the
    all-NumPy layer, with the same cache writes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    (cache, plan, tokens), (host, host_plan, _) = _cpu_step(path), _cpu_step(path)
    assert plan.path == path
    for given_out in (False, True):
        q, k, v = (rng.standard_normal((tokens, n, 32)).astype(np.float32) for n in (4, 2, 2))
        want = host_plan.attention(q, k, v, *host.layer(0))
        layer = cache.layer(0) if caches == "numpy" else tuple(torch.from_numpy(c) for c in cache.layer(0))
        out = torch.full((tokens, 4, 32), float("nan")) if given_out else None
        got = plan.attention(*(torch.from_numpy(x) for x in (q, k, v)), *layer, out=out)
        assert isinstance(got, torch.Tensor) and (got is out if given_out else True)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(cache.layer(0)[0], host.layer(0)[0])
        np.testing.assert_array_equal(cache.layer(0)[1], host.layer(0)[1])


@pytest.mark.parametrize("path", ["varlen", "split", "ragged"])
def test_an_out_the_attention_refuses_is_refused_before_the_cache_write(path):
    """On the paths that write the K/V before attending, a non-contiguous ``out`` raises naming
    ``out`` with the cache untouched (bad input before any work)."""
    cache, plan, tokens = _cpu_step(path)
    before = [c.copy() for c in cache.layer(0)]
    q, k, v = (np.ones((tokens, n, 32), np.float32) for n in (4, 2, 2))
    with pytest.raises(ValueError, match="^out must be C-contiguous"):
        plan.attention(q, k, v, *cache.layer(0), out=np.zeros((tokens, 4, 64), np.float32)[..., ::2])
    for now, then in zip(cache.layer(0), before):
        np.testing.assert_array_equal(now, then)


@pytest.mark.parametrize("path", ["decode", "varlen", "split", "ragged"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("extra", [-1, 1])
def test_rows_other_than_the_plans_tokens_are_refused_before_any_work(path, name, extra):
    """q, k or v with one row fewer or more than the plan's tokens: a ValueError naming it, the cache
    untouched (a short q would otherwise be read past its end, a long one leave rows unwritten)."""
    cache, plan, tokens = _cpu_step(path)
    before = [c.copy() for c in cache.layer(0)]
    arrays = {n: np.ones((tokens + (extra if n == name else 0), heads, 32), np.float32)
              for n, heads in (("q", 4), ("k", 2), ("v", 2))}
    with pytest.raises(ValueError, match=f"^{name} must have shape \\[num_tokens"):
        plan.attention(arrays["q"], arrays["k"], arrays["v"], *cache.layer(0))
    for now, then in zip(cache.layer(0), before):
        np.testing.assert_array_equal(now, then)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "varlen", "ragged"])
def test_torch_layers_beside_a_cupy_cache_are_resolved_once(path):
    """q, k and v as torch tensors beside the plan's CuPy cache (a torch model over a
    ``PagedAttentionCache``): every layer equals the CPU reference, the result is a torch tensor,
    and the plan resolves its launch on the first layer only (arrays of two kinds are still
    memoised: each is read as its own kind)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    rng = np.random.default_rng(11)
    layers, kv_heads, heads, dim = 3, 2, 8, 64
    cache, host, plan, host_plan, lens = _two_sequence_plans(path, layers, heads, kv_heads, dim)
    for layer in range(layers):
        q, k, v = (rng.standard_normal((sum(lens), n, dim)).astype(np.float16) for n in (heads, kv_heads, kv_heads))
        got = plan.attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), *cache.layer(layer))
        assert isinstance(got, torch.Tensor)
        want = host_plan.attention(q, k, v, *host.layer(layer))
        np.testing.assert_allclose(got.float().cpu().numpy(), want.astype(np.float32), rtol=5e-3, atol=5e-3)
        np.testing.assert_array_equal(cache.layer(layer)[0].get(), host.layer(layer)[0])  # the same writes
    assert len(plan._layers) == 1, list(plan._layers)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "varlen", "ragged"])
def test_a_resolved_layer_still_refuses_a_wrongly_typed_equal_scalar(path):
    """After a layer resolved with ``softmax_scale=1.0`` (and on the ragged path ``softcap=0.0``),
    ``softmax_scale=True`` / ``softcap=False`` -- equal values of the wrong type -- are refused with a
    TypeError naming the argument, as on a first call."""
    import cupy

    rng = np.random.default_rng(13)
    cache, _, plan, _, lens = _two_sequence_plans(path, 1, 8, 2, 64)
    q, k, v = (cupy.asarray(rng.standard_normal((sum(lens), n, 64)).astype(np.float16)) for n in (8, 2, 2))
    options = dict(softcap=0.0) if path == "ragged" else {}
    plan.attention(q, k, v, *cache.layer(0), 1.0, **options)
    plan.attention(q, k, v, *cache.layer(0), 1.0, **options)  # resolved now
    with pytest.raises(TypeError, match="^softmax_scale"):
        plan.attention(q, k, v, *cache.layer(0), True, **options)
    if options:
        with pytest.raises(TypeError, match="^softcap"):
            plan.attention(q, k, v, *cache.layer(0), 1.0, softcap=False)


def _segment_stream(torch, ptr: int):
    """The stream torch's caching allocator gave the memory at ``ptr`` out on, or None when its
    snapshot does not say."""
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return segment.get("stream")
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "varlen", "ragged"])
def test_torch_layer_on_a_named_busy_stream(path):
    """``stream=`` a torch side stream that sleeps on the GPU while q, k and v are written on it: the
    layer runs after them (right every round), and a new output comes from that stream's pool, as
    the public calls allocate on a named stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    rng = np.random.default_rng(12)
    kv_heads, heads, dim = 2, 8, 64
    cache, host, plan, host_plan, lens = _two_sequence_plans(path, 1, heads, kv_heads, dim)
    side = torch.cuda.Stream()
    for round_ in range(3):  # each round writes its new keys over the last round's, on both sides
        q, k, v = (rng.standard_normal((sum(lens), n, dim)).astype(np.float16) for n in (heads, kv_heads, kv_heads))
        sources = [torch.from_numpy(x).cuda() for x in (q, k, v)]
        targets = [torch.full_like(x, float("nan")) for x in sources]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            for target, source in zip(targets, sources):
                target.copy_(source)
        got = plan.attention(*targets, *cache.layer(0), stream=side)
        assert isinstance(got, torch.Tensor)
        with torch.cuda.stream(side):
            fetched = got.float().cpu().numpy()
        want = host_plan.attention(q, k, v, *host.layer(0))
        np.testing.assert_allclose(fetched, want.astype(np.float32), rtol=5e-3, atol=5e-3, err_msg=f"round {round_}")
        owner = _segment_stream(torch, got.data_ptr())
        if owner is not None:
            assert owner == side.cuda_stream, "the output was not allocated on the named stream"
    torch.cuda.synchronize()


PLAN_ARRAYS = ("input_ids", "positions", "query_lens", "cache_seqlens", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k",
               "slot_mapping", "block_table", "logits_indices", "tail_cu_seqlens_q", "sample_mask")


@pytest.mark.parametrize("seed", range(4))
def test_decode_pass_equals_the_general_plan(seed):
    """``build_plan(..., 1, buffers=...)`` takes the one-pass decode fill; over steps that grow,
    fork, free and reorder rows, padded or not, with or without input ids, each plan equals the
    general fill's (query lengths given as an array) in buffers of its own, and an unreserved slot
    gets the general path's error."""
    rng = np.random.default_rng(seed)
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=64, dtype="float32", device="cpu",
                                max_blocks_per_seq=8)
    fast, general = (PlanBuffers(max_batch=8, max_tokens=8, max_blocks_per_seq=8) for _ in range(2))
    live, tokens = [], {}
    for step in range(40):
        if len(live) < 6 and rng.random() < 0.4:
            name = f"s{step}"
            tokens[name] = rng.integers(0, 9, int(rng.integers(1, 30))).tolist()
            cache.allocate(name, tokens[name])
            cache.mark_computed([name])
            live.append(name)
        elif len(live) > 1 and rng.random() < 0.15:
            cache.free(live.pop(int(rng.integers(0, len(live)))))
        elif live and rng.random() < 0.15:
            parent = live[int(rng.integers(0, len(live)))]
            tokens[f"f{step}"] = list(tokens[parent])
            cache.fork(parent, f"f{step}", tokens[f"f{step}"])
            live.append(f"f{step}")
        if not live:
            continue
        batch = [live[i] for i in rng.permutation(len(live))[:int(rng.integers(1, len(live) + 1))]]
        cache.grow(batch, 1)
        for name in batch:
            tokens[name].append(int(rng.integers(0, 9)))
        ids = rng.integers(0, 100, len(batch)) if rng.random() < 0.7 else None
        size = int(rng.integers(len(batch), 9)) if rng.random() < 0.5 else None
        one = build_plan(cache, batch, 1, ids, buffers=fast, batch_size=size, num_tokens=size)
        ref = build_plan(cache, batch, np.ones(len(batch), np.int64), ids, buffers=general, batch_size=size,
                         num_tokens=size)
        assert one.path == ref.path == "decode" and one.seq_ids == ref.seq_ids
        assert (one.max_seqlen_q, one.max_seqlen_k, one.num_split) == (ref.max_seqlen_q, ref.max_seqlen_k, 0)
        for name in PLAN_ARRAYS:
            a, b = getattr(one, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            assert a is None or np.array_equal(a, b), name
        cache.mark_computed(batch)
    with pytest.raises(ValueError, match=r"query_lens\[0\] = 1 must be >= 1 and fit the 0 slots reserved"):
        build_plan(cache, live[:1], 1, buffers=fast)
