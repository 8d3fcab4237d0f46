"""The array boundary: NumPy stays on the CPU, CUDA arrays become zero-copy CuPy views."""
import numpy as np
import pytest

from cupy_paged._core.arrays import as_array, backend_of


def test_numpy_passes_through():
    x = np.ones((2, 3), np.float16)
    assert as_array(x, "q") is x
    assert backend_of({"q": x, "k": None}) == "cpu"


def test_host_dlpack_becomes_numpy_without_copy():
    class HostTensor:  # a CPU tensor of another framework, seen only through DLPack
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    x = np.arange(6, dtype=np.float32)
    y = as_array(HostTensor(x), "q")
    assert isinstance(y, np.ndarray) and np.shares_memory(x, y)


def test_unknown_objects_are_refused_by_name():
    with pytest.raises(TypeError, match="^block_table must be a NumPy array"):
        as_array([[0, 1]], "block_table")


@pytest.mark.gpu
def test_cuda_arrays_are_zero_copy():
    import cupy

    x = cupy.arange(8, dtype=cupy.float32)
    assert as_array(x, "q") is x
    numba_cuda = pytest.importorskip("numba.cuda")
    device = numba_cuda.to_device(np.arange(4, dtype=np.float32))
    view = as_array(device, "q")  # through __cuda_array_interface__
    view[0] = 42
    assert device.copy_to_host()[0] == 42
    assert backend_of({"q": view, "k": x}) == "cuda"


@pytest.mark.gpu
def test_torch_tensors_through_dlpack_share_memory():
    torch = pytest.importorskip("torch")
    import cupy_paged

    t = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(t)
    k_new = torch.randn(3, 2, 64, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 17, 63], dtype=torch.int32, device="cuda")
    cupy_paged.write_kv_cache(t, v, k_new, k_new, slots)
    torch.cuda.synchronize()
    assert torch.equal(t[1, 1], k_new[1]) and torch.equal(v[3, 15], k_new[2])


@pytest.mark.gpu
def test_jax_arrays_through_dlpack():
    jnp = pytest.importorskip("jax.numpy")
    import cupy

    x = jnp.arange(16, dtype=jnp.float32)
    view = as_array(x, "q")
    assert isinstance(view, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(view), np.arange(16, dtype=np.float32))


def _decode_example(rng, dtype):
    """The source's decode example (cached 30 / 32 / 70 keys, block 32, shuffled blocks) with one new
    token each: NumPy arguments, and the reference's output and caches after the append."""
    import cupy_paged

    args = dict(q=rng.standard_normal((3, 1, 4, 64)).astype(dtype),
                k_cache=rng.standard_normal((8, 32, 2, 64)).astype(dtype),
                v_cache=rng.standard_normal((8, 32, 2, 64)).astype(dtype),
                k=rng.standard_normal((3, 1, 2, 64)).astype(dtype), v=rng.standard_normal((3, 1, 2, 64)).astype(dtype),
                cache_seqlens=np.array([30, 32, 70], np.int32),
                block_table=cupy_paged.block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4))
    ref = {name: value.copy() for name, value in args.items()}
    out = cupy_paged.flash_attn_with_kvcache(**ref, causal=True)
    return args, out, ref["k_cache"], ref["v_cache"]


@pytest.mark.gpu
def test_numba_device_arrays_into_the_decode_function():
    """numba device arrays straight into ``flash_attn_with_kvcache``: the new tokens land in the
    numba caches in place (read back through numba), and the output, a CuPy array, equals the
    reference."""
    numba_cuda = pytest.importorskip("numba.cuda")
    import cupy

    import cupy_paged
    from _util import assert_close

    args, want, want_k, want_v = _decode_example(np.random.default_rng(1), np.float16)
    device = {name: numba_cuda.to_device(value) for name, value in args.items()}
    out = cupy_paged.flash_attn_with_kvcache(**device, causal=True)
    assert isinstance(out, cupy.ndarray) and out.shape == want.shape
    assert_close(out, want, np.float16)
    np.testing.assert_array_equal(device["k_cache"].copy_to_host(), want_k)
    np.testing.assert_array_equal(device["v_cache"].copy_to_host(), want_v)
    assert cupy_paged.check_errors() is None


@pytest.mark.gpu
def test_jax_arrays_into_the_varlen_function():
    """JAX arrays (bfloat16, on the GPU) straight into ``flash_attn_varlen_func``, the source's varlen
    example (query lengths 10 / 3 / 1 over key lengths 0 / 1 / 7): the output, a CuPy array, equals
    the reference, and the row with no key is zeros."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX sees no GPU")
    import cupy

    import cupy_paged
    from _util import assert_close
    from cupy_paged._core.types import BF16

    rng = np.random.default_rng(2)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths([10, 3, 1])
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths([0, 1, 7])
    q = rng.standard_normal((14, 4, 64)).astype(BF16)
    k, v = (rng.standard_normal((8, 2, 64)).astype(BF16) for _ in range(2))
    want = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    out = cupy_paged.flash_attn_varlen_func(*(jax.numpy.asarray(x) for x in (q, k, v, cu_q, cu_k)), max_q, max_k,
                                            causal=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == BF16
    assert_close(out, want, BF16)
    assert not cupy.asnumpy(out[:10]).astype(np.float32).any(), "r0 sees no key: its rows are zeros"


def test_slot_mapping_from_torch_tensors_is_a_torch_tensor():
    """Torch CPU tensors in, a torch tensor out, the same slots as from NumPy; float ids rejected by name."""
    torch = pytest.importorskip("torch")
    import cupy_paged

    table = cupy_paged.block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4)
    slots = cupy_paged.slot_mapping_from_positions(torch.from_numpy(table), torch.tensor([0, 1, 2]),
                                                   torch.tensor([30, 32, 70]), 32)
    assert isinstance(slots, torch.Tensor) and slots.tolist() == [94, 32, 198]
    with pytest.raises(TypeError, match="seq_ids"):
        cupy_paged.slot_mapping_from_positions(torch.from_numpy(table), torch.tensor([0.5]), torch.tensor([3]), 32)


def test_cupy_stream_wraps_a_handle_without_the_deprecated_external_stream():
    """A cudaStream_t handle becomes a CuPy stream through the CUDA stream protocol (no
    ExternalStream deprecation warning, nothing on the GPU touched), the null stream for 0."""
    import warnings

    import cupy

    from cupy_paged._core.arrays import cupy_stream

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = cupy_stream(0x7F00)
    assert isinstance(stream, cupy.cuda.Stream) and stream.ptr == 0x7F00
    assert cupy_stream(0) is cupy.cuda.Stream.null


class _CupyLike:
    """Quacks like a CuPy array for the memoised path's readers, without a GPU."""

    class _Memory:
        ptr, device_id = 4096, 0

    def __init__(self, shape):
        self.shape, self.strides, self.dtype, self.data = shape, (8,) * len(shape), np.dtype(np.float16), self._Memory()


def test_memo_lookup_reads_keys_and_falls_back(monkeypatch):
    """``memo_lookup``: one kind's readers key the call and find its memo entry; a host array among
    the arrays (bfloat16 too, whose buffer cannot be exported) or an unhashable argument keys
    nothing, so the call takes the checked path."""
    from cupy_paged._core import arrays
    from cupy_paged._core.types import BF16

    monkeypatch.setitem(arrays._KIND_OF_TYPE, _CupyLike, arrays.CUPY)
    key_of = lambda s, a, b, option: ("call", s(a), s(b), option)  # noqa: E731
    a, b = _CupyLike((2, 3)), _CupyLike((4,))
    key = ("call", ((2, 3), (8, 8), np.dtype(np.float16), 0), ((4,), (8,), np.dtype(np.float16), 0), 1.5)
    found, ptr = object(), arrays.FAST_READERS[arrays.CUPY][1]
    assert arrays.memo_lookup({key: found}, arrays.CUPY, key_of, a, b, 1.5) == (key, found, ptr)
    assert arrays.memo_lookup({}, arrays.CUPY, key_of, a, b, 1.5) == (key, None, ptr)
    for host in (np.zeros(4, np.float16), np.zeros(4, BF16)):
        assert arrays.memo_lookup({key: found}, arrays.CUPY, key_of, a, host, 1.5)[:2] == (None, None)
    assert arrays.memo_lookup({key: found}, arrays.CUPY, key_of, a, b, [1.5])[:2] == (None, None)


class _TorchLike:
    """Quacks like a torch tensor for the memoised path's readers, without torch."""

    requires_grad = False

    def __init__(self, shape):
        self.shape, self.dtype = shape, np.dtype(np.float16)

    def stride(self):
        return (1,) * len(self.shape)

    def get_device(self):
        return 0

    def data_ptr(self):
        return 8192


def test_memo_lookup_starts_where_the_call_path_last_needed_each_arrays_reader(monkeypatch):
    """A torch tensor beside a CuPy array fails the torch readers part-way; memo_lookup then reads
    each array as its own kind, and later calls of that key function start there: the same key
    (so the same memo entry), the per-array pointer reader, same-kind calls still keyed; another
    key function keeps the kind's own readers."""
    from cupy_paged._core import arrays

    monkeypatch.setitem(arrays._KIND_OF_TYPE, _CupyLike, arrays.CUPY)
    monkeypatch.setitem(arrays._KIND_OF_TYPE, _TorchLike, arrays.TORCH)
    monkeypatch.setattr(arrays, "_MIXED", set())
    key_of = lambda s, a, b: ("call", s(a), s(b))  # noqa: E731
    other_key_of = lambda s, a, b: ("other", s(a), s(b))  # noqa: E731
    t, c = _TorchLike((2, 3)), _CupyLike((4,))
    mixed = ("call", ((2, 3), (1, 1), np.dtype(np.float16), 0), ((4,), (8,), np.dtype(np.float16), 0))
    found = object()
    assert arrays.memo_lookup({mixed: found}, arrays.TORCH, key_of, t, c) == (mixed, found, arrays.data_ptr)
    assert arrays._MIXED == {(key_of, arrays.TORCH)}
    assert arrays.memo_lookup({mixed: found}, arrays.TORCH, key_of, t, c) == (mixed, found, arrays.data_ptr)
    same = ("call", ((2, 3), (1, 1), np.dtype(np.float16), 0), ((5,), (1,), np.dtype(np.float16), 0))
    assert arrays.memo_lookup({}, arrays.TORCH, key_of, t, _TorchLike((5,)))[0] == same
    assert arrays.memo_lookup({}, arrays.TORCH, other_key_of, t, _TorchLike((5,)))[2] is arrays.FAST_READERS[arrays.TORCH][1]
    assert arrays.memo_lookup({}, arrays.TORCH, key_of, t, np.zeros(4, np.float16))[:2] == (None, None)
    # A host array keys nothing either way: it does not move a call path to each array's reader.
    assert arrays.memo_lookup({}, arrays.TORCH, other_key_of, t, np.zeros(4, np.float16))[:2] == (None, None)
    assert (other_key_of, arrays.TORCH) not in arrays._MIXED


def test_torch_stream_wraps_the_default_stream_not_a_new_one():
    """A raw handle becomes torch's stream object of that very handle: 0 is the legacy default
    stream, which torch's ExternalStream(0) does not wrap (it makes a pooled stream, so a copy put
    there ran unordered with a kernel on stream 0: flash_attn_func's LSE, 2026-12-03)."""
    import types

    from cupy_paged._core.arrays import torch_stream

    made = []

    def external(handle):
        made.append(("ExternalStream", handle))
        return ("pooled" if handle == 0 else "external", handle)

    def from_external(handle):
        made.append(("get_stream_from_external", handle))
        return ("wrapped", handle)

    new_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_stream_from_external=from_external, ExternalStream=external, default_stream=lambda: ("default", 0)))
    assert torch_stream(new_torch, 0) == ("wrapped", 0)
    assert torch_stream(new_torch, 1234) == ("wrapped", 1234)
    old_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=external,
                                                                 default_stream=lambda: ("default", 0)))
    assert torch_stream(old_torch, 0) == ("default", 0)
    assert torch_stream(old_torch, 1234) == ("external", 1234)
    assert ("ExternalStream", 0) not in made


def test_cu_seqlens_of_a_torch_tensor_is_a_torch_tensor_on_its_device():
    """A torch CPU tensor of lengths gives torch back (it went to CuPy before: an error without a GPU)."""
    torch = pytest.importorskip("torch")
    import cupy_paged

    cu, longest = cupy_paged.cu_seqlens_from_lengths(torch.tensor([3, 1, 4]))
    assert isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.device.type == "cpu"
    assert cu.tolist() == [0, 3, 4, 8] and longest == 4
    np_cu, _ = cupy_paged.cu_seqlens_from_lengths(torch.tensor([3, 1, 4]), xp=np)
    assert isinstance(np_cu, np.ndarray) and np_cu.tolist() == [0, 3, 4, 8]
