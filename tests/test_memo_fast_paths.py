"""A memoised call refuses what its first call refused: the fast paths of the public calls and of
the step plan's layers take a remembered launch only for arguments the first call's host checks
would pass (16-byte aligned outputs, rotary rows for every position rotated, int32 maxima).

The CPU tests drive the real call paths with stand-in CuPy arrays (shape, strides, dtype,
``data.ptr``, ``data.device_id``) and the launches replaced by recorders; the GPU tests make the
same calls on real arrays."""
import numpy as np
import pytest

from _util import randn

F16, F32, I32 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int32)
RNG = np.random.default_rng(3)


class _Stand:
    """A C-contiguous stand-in CuPy array at ``ptr`` on device 0 (no memory behind it)."""

    _next = [1 << 24]

    def __init__(self, shape, dtype, misalign=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(self.shape)
        self.size = int(np.prod(self.shape))
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(self.ndim))
        _Stand._next[0] += 1 << 20

        class _Memory:
            ptr, device_id = _Stand._next[0] + misalign, 0
        self.data = _Memory()


class _Recorder:
    """A resolved launch that records its runs instead of launching."""

    def __init__(self, want_lse=False, **attrs):
        self.device, self.want_lse, self.runs = 0, want_lse, []
        self.__dict__.update(attrs)

    def run(self, kind, like, ptrs, scalar, out, lse_out, stream, alloc_stream=None):
        self.runs.append((ptrs, scalar, out, lse_out))
        return (None if out is None else out[0]), (None if lse_out is None else lse_out[0])


@pytest.fixture
def stand_ins(monkeypatch):
    """Stand-ins read as CuPy arrays on device 0, the memo empty before and after."""
    from cupy_paged._core import arrays
    from cupy_paged.api import _call, decode, varlen

    monkeypatch.setitem(arrays._KIND_OF_TYPE, _Stand, arrays.CUPY)
    for module in (_call, decode, varlen):
        monkeypatch.setattr(module, "current_device", lambda: 0)
    _call.MEMO.clear()
    yield
    _call.MEMO.clear()


def _varlen_recorders(monkeypatch):
    from cupy_paged import kernels

    built = []
    monkeypatch.setattr(kernels.varlen, "VarlenLaunch", lambda p: built.append(_Recorder(p.want_lse)) or built[-1])
    return built


def _paged_varlen(**change):
    args = dict(q=_Stand((5, 8, 64), F16), k=_Stand((4, 16, 2, 64), F16), v=_Stand((4, 16, 2, 64), F16),
                cu_seqlens_q=_Stand((3,), I32), cu_seqlens_k=_Stand((3,), I32), max_seqlen_q=3, max_seqlen_k=9,
                block_table=_Stand((2, 2), I32), stream=0)
    args.update(change)
    return args


@pytest.mark.parametrize("name", ["out", "lse_out"])
def test_varlen_memoised_call_refuses_a_misaligned_output(name, stand_ins, monkeypatch):
    """The varlen kernels store 16 bytes at a time into out: a misaligned out of the remembered
    shape is refused as on a first call, never handed to the remembered launch."""
    import cupy_paged

    built = _varlen_recorders(monkeypatch)
    shape, dtype = ((5, 8, 64), F16) if name == "out" else ((8, 5), F32)
    extra = {} if name == "out" else {"return_softmax_lse": True}
    cupy_paged.flash_attn_varlen_func(**_paged_varlen(**{name: _Stand(shape, dtype)}), **extra)
    assert len(built) == 1 and len(built[0].runs) == 1
    with pytest.raises(ValueError, match=f"^{name} must start on a 16-byte boundary"):
        cupy_paged.flash_attn_varlen_func(**_paged_varlen(**{name: _Stand(shape, dtype, misalign=2)}), **extra)
    assert len(built[0].runs) == 1


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_varlen_memoised_call_refuses_maxima_past_int32(name, stand_ins, monkeypatch):
    import cupy_paged

    built = _varlen_recorders(monkeypatch)
    cupy_paged.flash_attn_varlen_func(**_paged_varlen())
    with pytest.raises(ValueError, match=name):
        cupy_paged.flash_attn_varlen_func(**_paged_varlen(**{name: 2 ** 31}))
    assert len(built[0].runs) == 1


def _decode_recorders(monkeypatch):
    """launch_for replaced by recorders holding what the fast path reads from a DecodeLaunch; the
    length limit as DecodeLaunch computes it (its own test on the GPU below)."""
    from cupy_paged import kernels

    built = []

    def launch_for(p):
        capacity = int(p.k_cache.shape[1])
        limit = capacity - p.seqlen_new
        if p.rotary_cos is not None:
            limit = min(limit, int(p.rotary_cos.shape[0]) - max(p.seqlen_new, 1))
        built.append(_Recorder(p.want_lse or p.lse is not None, int_length_max=limit, capacity=capacity,
                               seqlen_new=p.seqlen_new,
                               cached_default=p.cache_seqlens if isinstance(p.cache_seqlens, int) else 0))
        return built[-1]
    monkeypatch.setattr(kernels.decode, "launch_for", launch_for)
    return built


def test_decode_memoised_int_length_refuses_positions_past_the_rotary_table(stand_ins, monkeypatch):
    """An int cache_seqlens over a contiguous cache with rotary tables: a later call whose position
    lies past the table's rows is refused as on a first call (before, it launched and left q and
    the new key unrotated, the key written so into the cache)."""
    import cupy_paged

    built = _decode_recorders(monkeypatch)
    q, kc, vc = _Stand((2, 1, 8, 64), F16), _Stand((2, 64, 2, 64), F16), _Stand((2, 64, 2, 64), F16)
    k, v, cos, sin = _Stand((2, 1, 2, 64), F16), _Stand((2, 1, 2, 64), F16), _Stand((16, 16), F16), _Stand((16, 16), F16)

    def call(n):
        return cupy_paged.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=n,
                                                  causal=True, stream=0)
    call(4)
    call(15)  # the last row of the table: taken by the remembered launch
    assert len(built) == 1 and [r[1] for r in built[0].runs] == [4, 15]
    with pytest.raises(ValueError, match="rotary_cos has 16 rows but position 16 is rotated"):
        call(16)
    assert len(built[0].runs) == 2


@pytest.mark.parametrize("name", ["out", "lse_out"])
def test_decode_memoised_call_refuses_a_misaligned_output(name, stand_ins, monkeypatch):
    import cupy_paged

    built = _decode_recorders(monkeypatch)
    shapes = {"out": ((2, 1, 8, 64), F16), "lse_out": ((2, 8, 1), F32)}

    def call(misalign):
        return cupy_paged.flash_attn_with_kvcache(
            _Stand((2, 1, 8, 64), F16), _Stand((4, 16, 2, 64), F16), _Stand((4, 16, 2, 64), F16),
            cache_seqlens=_Stand((2,), I32), block_table=_Stand((2, 2), I32), stream=0,
            **{name: _Stand(*shapes[name], misalign=misalign)})
    call(0)
    with pytest.raises(ValueError, match=f"^{name} must start on a 16-byte boundary"):
        call(4)
    assert len(built[0].runs) == 1


def test_plan_layer_refuses_a_misaligned_out(stand_ins):
    """A resolved varlen layer of a step plan refuses an out off a 16-byte boundary before any
    launch (the first layer's checks saw only its own out)."""
    from cupy_paged._core import arrays
    from cupy_paged.runtime import _layer

    layer = object.__new__(_layer.LayerLaunch)
    layer.device, layer.ragged, layer.decode, layer.split = 0, False, False, None
    layer.launch, layer.write = _Recorder(dtype=F16), _Recorder()
    layer.write.run = lambda *a: layer.write.runs.append(a)
    layer.index_ptrs, layer.max_seqlen_q, layer.out_shape, layer.out_like_q = (1, 2, 3, 4), 3, (6, 8, 64), False
    q, k, v = _Stand((6, 8, 64), F16), _Stand((6, 2, 64), F16), _Stand((6, 2, 64), F16)
    kc, vc = _Stand((4, 16, 2, 64), F16), _Stand((4, 16, 2, 64), F16)
    ptr = arrays.FAST_READERS[arrays.CUPY][1]
    layer.run(arrays.CUPY, q, k, v, kc, vc, _Stand((6, 8, 64), F16), 0, None, ptr)
    with pytest.raises(ValueError, match="^out of a layer must start on a 16-byte boundary"):
        layer.run(arrays.CUPY, q, k, v, kc, vc, _Stand((6, 8, 64), F16, misalign=2), 0, None, ptr)
    assert len(layer.launch.runs) == 1 and len(layer.write.runs) == 1


@pytest.mark.gpu
def test_decode_launch_limits_int_lengths_by_the_rotary_table():
    """On the GPU: the real DecodeLaunch's limit, and the call through it, after a remembered call."""
    import cupy

    import cupy_paged

    q = cupy.asarray(randn(RNG, (2, 1, 8, 64), F16))
    kc, vc = (cupy.asarray(randn(RNG, (2, 64, 2, 64), F16)) for _ in range(2))
    k, v = (cupy.asarray(randn(RNG, (2, 1, 2, 64), F16)) for _ in range(2))
    cos, sin = (cupy.asarray(randn(RNG, (16, 16), F16)) for _ in range(2))
    call = lambda n: cupy_paged.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                                        cache_seqlens=n, causal=True)
    call(4)
    call(15)
    with pytest.raises(ValueError, match="rotary_cos has 16 rows but position 16 is rotated"):
        call(16)
    cupy_paged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["out", "lse_out"])
def test_varlen_misaligned_output_refused_after_a_remembered_call_on_the_gpu(name):
    import cupy

    import cupy_paged

    q = cupy.asarray(randn(RNG, (5, 8, 64), F16))
    k, v = (cupy.asarray(randn(RNG, (9, 2, 64), F16)) for _ in range(2))
    cu_q, cu_k = cupy.asarray(np.array([0, 3, 5], I32)), cupy.asarray(np.array([0, 4, 9], I32))
    shape, dtype = ((5, 8, 64), F16) if name == "out" else ((8, 5), F32)
    flat = cupy.zeros(int(np.prod(shape)) + 8, dtype)
    aligned, misaligned = flat[:-8].reshape(shape), flat[1:-7].reshape(shape)
    extra = {} if name == "out" else {"return_softmax_lse": True}
    cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, **{name: aligned}, **extra)
    with pytest.raises(ValueError, match=f"^{name} must start on a 16-byte boundary"):
        cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, **{name: misaligned}, **extra)
    cupy_paged.check_errors()


def test_plan_layer_is_built_and_launched_on_the_device_of_q(stand_ins, monkeypatch):
    """A step plan's layer whose arrays live on another device than the current one is resolved and
    launched inside that device's context (its kernels load there; the public calls do the same),
    and the current device is left as it was."""
    import contextlib

    from cupy_paged._core import arrays
    from cupy_paged.runtime import plan as plan_module

    current = [0]

    @contextlib.contextmanager
    def on_device(device):
        before, current[0] = current[0], device
        yield
        current[0] = before

    class Layer:
        def __init__(self, plan, q, *args, **kwargs):
            self.device, self.built_on, self.ran_on = 1, current[0], []

        def run(self, *args):
            self.ran_on.append(current[0])
            return "out"

    monkeypatch.setattr(plan_module, "current_device", lambda: current[0], raising=False)
    monkeypatch.setattr(plan_module, "on_device", on_device, raising=False)
    monkeypatch.setattr(plan_module, "LayerLaunch", Layer)
    step = object.__new__(plan_module.StepPlan)
    step.path = plan_module.VARLEN

    def on_one(shape, dtype):
        array = _Stand(shape, dtype)
        array.data.device_id = 1
        return array
    arrays_ = [on_one((6, 8, 64), F16), on_one((6, 2, 64), F16), on_one((6, 2, 64), F16),
               on_one((4, 16, 2, 64), F16), on_one((4, 16, 2, 64), F16)]
    assert arrays._KIND_OF_TYPE[_Stand] is arrays.CUPY
    assert step.attention(*arrays_) == "out" and step.attention(*arrays_) == "out"
    (layer,) = step._layers.values()
    assert layer.built_on == 1 and layer.ran_on == [1, 1] and current[0] == 0
