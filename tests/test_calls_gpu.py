"""The public call path on the GPU: what a caller hands in, gets back, and can rely on.

* Outputs are of the caller's kind (torch tensors for torch inputs, CuPy arrays for CuPy inputs),
  on the inputs' device, sharing memory with an ``out=`` / ``lse_out=`` given; writes (cache
  appends, ``write_kv_cache``) are seen through the caller's own arrays.
* The work is ordered on the caller's stream: torch's current stream, CuPy's current stream, or
  ``stream=``.  The busy-stream tests keep a side stream asleep on the GPU, write the inputs on it
  after the sleep, call, and read the result on it at once: a call that ran anywhere else reads
  poisoned inputs or is read before it finishes.
* A default call never copies to or from the host and never synchronises: it can be captured in
  a CUDA graph (torch's and CuPy's), it returns while its stream is still asleep, and it calls
  none of the host-copy or sync entry points of CuPy and torch.
* Hostile index values in device arrays (``check_values`` left at its default) are holes: the
  good sequences' outputs equal the CPU reference computed on them alone, nothing outside the
  arrays given is written (guard regions around the caches and outputs), and
  ``cupy_paged.check_errors()`` raises a ``ValueError`` naming the argument and the sequence (or
  token), then is clear.  ``check_values=True`` rejects the same inputs before any work.  Those
  tests carry ``sanitize`` in their names for ``compute-sanitizer`` (``-k sanitize``).

Ground truth is the CPU reference backend: the same public function called with NumPy copies.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import zlib

import numpy as np
import pytest

import cupy_paged
from cupy_paged._core.arrays import cupy_stream
from _util import BF16, assert_close, assert_same_bits, randn, sanitizer_tool, scatter_paged, shuffled_block_table

pytestmark = pytest.mark.gpu

F16 = np.dtype(np.float16)
HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 128, 16
LSE_RTOL = 2e-3
NAN_BITS = {BF16: 0x7FC0, F16: 0x7E00}  # a quiet NaN of each 2-byte float dtype
ROUNDS = 20          # busy-stream rounds per test
BUSY_SLEEP_S = 0.01  # how long the side stream sleeps before the inputs are written on it
LONG_SLEEP_S = 0.3   # the sleep a default call must not wait for


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def torch_cuda():
    """torch, where it is installed with CUDA (else the test skips)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _drain_errors() -> None:
    """Clear the device error word (another test's hostile inputs may have left a report)."""
    for _ in range(2):
        try:
            cupy_paged.check_errors()
        except ValueError:
            pass


@pytest.fixture(autouse=True)
def clean_error_word():
    """Every test starts with a clear error word and the debug switch off, and leaves the switch
    as it found it."""
    from cupy_paged._core import errors as _errors

    was_on = _errors.debug()
    cupy_paged.set_debug(False)
    _drain_errors()
    yield
    cupy_paged.set_debug(was_on)


# --------------------------------------------------------------------------- arrays of each kind

def is_torch(obj) -> bool:
    return type(obj).__module__.startswith("torch")


def to_device(value, kind: str):
    """A fresh device copy of a NumPy array, as a CuPy array or a torch CUDA tensor (anything
    else is returned as it is)."""
    if not isinstance(value, np.ndarray):
        return value
    value = np.ascontiguousarray(value)
    if kind == "cupy":
        import cupy

        return cupy.asarray(value)
    import torch

    if value.dtype == BF16:
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(value).cuda()


def device_args(args: dict, kind: str) -> dict:
    return {name: to_device(value, kind) for name, value in args.items()}


def host(obj):
    """A NumPy copy of a CuPy array or torch tensor, made on the current stream of its framework
    (None and NumPy arrays as they are)."""
    if obj is None or isinstance(obj, np.ndarray):
        return obj
    if is_torch(obj):
        import torch

        tensor = obj.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(BF16)
        return tensor.numpy()
    import cupy

    return cupy.asnumpy(obj)


def data_ptr(obj) -> int:
    return obj.data_ptr() if is_torch(obj) else obj.data.ptr


def numpy_dtype(obj) -> np.dtype:
    if is_torch(obj):
        import torch

        return {torch.bfloat16: BF16, torch.float16: F16, torch.float32: np.dtype(np.float32),
                torch.int32: np.dtype(np.int32)}[obj.dtype]
    return np.dtype(obj.dtype)


def empty_of_kind(like, shape, dtype):
    """An output buffer of ``like``'s kind and device, full of NaN (an unwritten element fails)."""
    dtype = np.dtype(dtype)
    if is_torch(like):
        import torch

        torch_dtype = {BF16: torch.bfloat16, F16: torch.float16, np.dtype(np.float32): torch.float32}[dtype]
        return torch.full(tuple(shape), float("nan"), dtype=torch_dtype, device=like.device)
    import cupy

    buffer = cupy.empty(tuple(shape), dtype)
    if dtype in NAN_BITS:
        buffer.view(np.uint16).fill(NAN_BITS[dtype])
    else:
        buffer.fill(np.nan)
    return buffer


def poison(array) -> None:
    """Overwrite a device array in place: NaN for floats, -1 for integers."""
    if is_torch(array):
        array.fill_(float("nan") if array.is_floating_point() else -1)
    elif np.dtype(array.dtype) in NAN_BITS:
        array.view(np.uint16).fill(NAN_BITS[np.dtype(array.dtype)])
    else:
        array.fill(np.nan if array.dtype.kind == "f" else -1)


def copy_into(dst, src) -> None:
    """``dst[...] = src`` on the current stream of their framework (device to device)."""
    if is_torch(dst):
        dst.copy_(src)
    else:
        dst.data.copy_from_device_async(src.data, src.nbytes)


def assign(dst, value: np.ndarray) -> None:
    """Host values into an existing device array, on the current stream of its framework."""
    if is_torch(dst):
        dst.copy_(to_device(value, "torch"))
    else:
        dst.set(np.ascontiguousarray(value))


def assert_kind(result, kind: str, like) -> None:
    """``result`` is of ``kind`` and on ``like``'s device."""
    if kind == "torch":
        import torch

        assert isinstance(result, torch.Tensor), f"torch inputs gave a {type(result).__name__}"
        assert result.device == like.device, f"result on {result.device}, inputs on {like.device}"
    else:
        import cupy

        assert isinstance(result, cupy.ndarray), f"CuPy inputs gave a {type(result).__name__}"
        assert result.device.id == like.device.id


def synchronize() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


# --------------------------------------------------------------------------- a sleeping stream

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    // The global timer counts nanoseconds whatever the SM clock: the sleep lasts what was asked.
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


@functools.cache
def _spin_kernel():
    import cupy

    return cupy.RawKernel(_SPIN_SOURCE, "spin")


def sleep_on(handle: int, seconds: float) -> None:
    """Keep the stream ``handle`` busy on the GPU for ``seconds`` (one thread spinning)."""
    with cupy_stream(handle):
        _spin_kernel()((1,), (1,), (np.uint64(int(seconds * 1e9)),))


# --------------------------------------------------------------------------- the calls

@dataclasses.dataclass
class Call:
    """One public call: the function, its NumPy arguments (arrays, ints, flags) and the names of
    the arguments it writes in place."""

    fn: object
    args: dict
    writes: tuple = ()

    def reference(self, **changes):
        """(result, {written name: array}) of the call on NumPy copies: the CPU reference."""
        args = {name: np.array(value) if isinstance(value, np.ndarray) else value
                for name, value in {**self.args, **changes}.items()}
        return self.fn(**args), {name: args[name] for name in self.writes}

    @property
    def dtype(self) -> np.dtype:
        return self.args[next(name for name in ("q", "k", "out_a") if name in self.args)].dtype

    @property
    def like(self) -> str:
        """The argument whose kind and device the result takes."""
        return next(name for name in ("q", "k_cache", "out_a") if name in self.args)

    def next_values(self, rng, step: int) -> dict:
        """New values for the next graph replay: every float input it does not write, redrawn;
        decode lengths one token on, fresh slots for a cache write."""
        new = {name: randn(rng, value.shape, value.dtype) for name, value in self.args.items()
               if isinstance(value, np.ndarray) and value.dtype in (BF16, F16) and name not in self.writes}
        for name, value in self.args.items():  # float32 inputs (the merge's LSEs): their -inf kept
            if isinstance(value, np.ndarray) and value.dtype == np.float32 and name not in self.writes:
                new[name] = np.where(np.isfinite(value), 3 * randn(rng, value.shape, np.float32), value)
        if "cache_seqlens" in self.args:
            new["cache_seqlens"] = self.args["cache_seqlens"] + step
        if "slot_mapping" in self.args:
            new["slot_mapping"] = _slots(rng, self.args["k_cache"].shape, self.args["slot_mapping"].shape[0])
        return new


def _slots(rng, cache_shape, tokens: int) -> np.ndarray:
    slots = rng.permutation(cache_shape[0] * cache_shape[1])[:tokens].astype(np.int32)
    slots[::5] = -1  # padding tokens
    return slots


LENS_Q, LENS_K = [37, 1, 130, 64], [37, 50, 200, 64]
GRAPH_STEPS = 3  # replays per graph test (decode tables hold room for as many appends)


def varlen_call(rng, paged: bool = False, dtype=BF16, **options) -> Call:
    """Causal varlen over four sequences (a 1-token one, one longer than a tile), contiguous K/V
    or paged caches behind a shuffled block table."""
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(LENS_Q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(LENS_K)
    k = randn(rng, (int(cu_k[-1]), KV_HEADS, DIM), dtype)
    v = randn(rng, (int(cu_k[-1]), KV_HEADS, DIM), dtype)
    args = dict(q=randn(rng, (int(cu_q[-1]), HEADS, DIM), dtype), k=k, v=v, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True, **options)
    if paged:
        (args["k"], args["v"]), args["block_table"] = scatter_paged(rng, [k, v], LENS_K, BLOCK)
    return Call(cupy_paged.flash_attn_varlen_func, args)


def decode_call(rng, dtype=BF16, **options) -> Call:
    """One query token and one new token per sequence over 0 to 333 cached keys, paged, shuffled."""
    seqlens = np.array([0, 15, 100, 333], np.int32)
    table, num_blocks = shuffled_block_table(rng, seqlens + GRAPH_STEPS, BLOCK)
    batch = seqlens.size
    args = dict(q=randn(rng, (batch, 1, HEADS, DIM), dtype),
                k_cache=randn(rng, (num_blocks, BLOCK, KV_HEADS, DIM), dtype),
                v_cache=randn(rng, (num_blocks, BLOCK, KV_HEADS, DIM), dtype),
                k=randn(rng, (batch, 1, KV_HEADS, DIM), dtype), v=randn(rng, (batch, 1, KV_HEADS, DIM), dtype),
                cache_seqlens=seqlens, block_table=table, causal=True, **options)
    return Call(cupy_paged.flash_attn_with_kvcache, args, writes=("k_cache", "v_cache"))


def func_call(rng, **options) -> Call:
    """A dense batch, 70 queries over 90 keys a sequence, float16."""
    args = dict(q=randn(rng, (2, 70, HEADS, DIM), F16), k=randn(rng, (2, 90, KV_HEADS, DIM), F16),
                v=randn(rng, (2, 90, KV_HEADS, DIM), F16), causal=True, **options)
    return Call(cupy_paged.flash_attn_func, args)


def write_call(rng) -> Call:
    """37 tokens into 6 blocks of 16 slots, every fifth token padding (slot -1)."""
    shape = (6, BLOCK, KV_HEADS, DIM)
    args = dict(k_cache=randn(rng, shape, BF16), v_cache=randn(rng, shape, BF16),
                k=randn(rng, (37, KV_HEADS, DIM), BF16), v=randn(rng, (37, KV_HEADS, DIM), BF16),
                slot_mapping=_slots(rng, shape, 37))
    return Call(cupy_paged.write_kv_cache, args, writes=("k_cache", "v_cache"))


def merge_call(rng) -> Call:
    """Two partial attentions of 37 tokens (varlen layout, bfloat16) merged by their LSEs; on every
    fifth token side b saw no key (LSE -inf), so side a alone gives the result there."""
    lse_b = 3 * rng.standard_normal((HEADS, 37)).astype(np.float32)
    lse_b[:, ::5] = -np.inf
    lse_a = 3 * rng.standard_normal((HEADS, 37)).astype(np.float32)
    args = dict(out_a=randn(rng, (37, HEADS, DIM), BF16), lse_a=lse_a, out_b=randn(rng, (37, HEADS, DIM), BF16),
                lse_b=lse_b)
    return Call(cupy_paged.merge_attention_states, args)


CALLS = {
    "varlen": varlen_call,
    "varlen_paged": functools.partial(varlen_call, paged=True),
    "decode": decode_call,
    "func": func_call,
    "write_kv_cache": write_call,
    "merge": merge_call,
}
ATTENTION = ["varlen", "varlen_paged", "decode", "func"]
# The caller's-kind test also runs the paged varlen and decode calls in float16 (the others bf16).
KIND_CALLS = {**CALLS, "varlen_paged_f16": functools.partial(varlen_call, paged=True, dtype=F16),
              "decode_f16": functools.partial(decode_call, dtype=F16)}
# The busy-stream tests also run flash_attn_func with its LSE (a transposed copy after the launch).
BUSY_CALLS = {**CALLS, "func_lse": functools.partial(func_call, return_attn_probs=True)}


def fetch(call: Call, result, args: dict):
    """Host copies of the call's result (a tuple stays a tuple) and of the arrays it writes."""
    got = tuple(host(x) for x in result) if isinstance(result, tuple) else host(result)
    return got, {name: host(args[name]) for name in call.writes}


def compare(call: Call, fetched, expected) -> None:
    """The fetched result and writes against the reference's."""
    (got, got_writes), (want, want_writes) = fetched, expected
    if call.fn is cupy_paged.write_kv_cache:
        assert got is None, f"write_kv_cache returned {type(got).__name__}"
    else:
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want), f"{len(got)} results, the reference gives {len(want)}"
        for i, (a, e) in enumerate(zip(got, want)):
            if e is None:
                assert a is None, f"result {i} should be None"
            elif i == 0:
                assert_close(a, e, call.dtype)
            else:
                assert_close(a, e, np.float32, what="lse", rtol=LSE_RTOL)
    for name in call.writes:
        assert_same_bits(got_writes[name], want_writes[name], name)


# --------------------------------------------------------------------------- the caller's kind

@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("name", ATTENTION + ["varlen_paged_f16", "decode_f16"])
def test_result_is_of_the_callers_kind(name, kind, request):
    """Default call: the result is of the inputs' kind and device, equals the reference, and
    cache appends are seen through the caller's caches; with ``out=`` the result is ``out``'s
    memory.  bfloat16, and float16 for the paged varlen and decode calls."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    call = KIND_CALLS[name](_rng(name, kind))
    expected = call.reference()
    args = device_args(call.args, kind)
    result = call.fn(**args)
    assert_kind(result, kind, args[call.like])
    assert numpy_dtype(result) == call.dtype
    compare(call, fetch(call, result, args), expected)

    args = device_args(call.args, kind)
    out = empty_of_kind(args["q"], call.args["q"].shape, call.dtype)
    result = call.fn(**args, out=out)
    assert data_ptr(result) == data_ptr(out), "the result is not out's memory"
    compare(call, fetch(call, out, args), expected)


@pytest.mark.parametrize("first", ["torch", "cupy"])
@pytest.mark.parametrize("name", list(CALLS))
def test_mixed_kinds_are_memoised_and_right(name, first, request, monkeypatch):
    """The first array (q; k_cache for write_kv_cache, out_a for the merge) of one kind and the rest of the other --
    torch tensors beside a CuPy cache, say: three calls in a row, each equal to the reference, the
    result of the first array's kind, and only the first call resolves its launch (the memoised
    path reads each array as its own kind when they are not all of one)."""
    request.getfixturevalue("torch_cuda")
    import cupy_paged.api._call
    import cupy_paged.api.decode
    import cupy_paged.api.kv_write
    import cupy_paged.api.varlen

    cupy_paged.api._call.MEMO.clear()  # no launch of an earlier test's calls
    resolved = []
    for module in (cupy_paged.api.decode, cupy_paged.api.varlen, cupy_paged.api.kv_write):
        monkeypatch.setattr(module, "remember", lambda key, launch, original=module.remember: (
            resolved.append(key), original(key, launch)))
    other = "cupy" if first == "torch" else "torch"
    rng = _rng(name, "mixed")
    call = CALLS[name](rng)
    for i in range(3):
        if i:  # new values of the same shapes (cache_seqlens one on, fresh slots): stale pointers would show
            call.args.update(call.next_values(rng, 1))
        expected = call.reference()
        args = device_args(call.args, other)
        args[call.like] = to_device(call.args[call.like], first)
        result = call.fn(**args)
        if call.fn is not cupy_paged.write_kv_cache:
            assert_kind(result if not isinstance(result, tuple) else result[0], first, args[call.like])
        compare(call, fetch(call, result, args), expected)
        if name not in ("func", "merge"):  # flash_attn_func and the merge resolve every call (no memo)
            assert len(resolved) == 1 and resolved[0] is not None, f"call {i}: launches resolved {resolved}"


# (options, whether lse_out= is accepted) per call
LSE_OPTIONS = {
    "varlen": [({"return_softmax_lse": True}, True), ({"return_attn_probs": True}, True)],
    "varlen_paged": [({"return_softmax_lse": True}, True)],
    "decode": [({"return_softmax_lse": True}, True)],
    "func": [({"return_attn_probs": True}, False)],
}


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("name", list(LSE_OPTIONS))
def test_lse_is_of_the_callers_kind(name, kind, request):
    """The LSE (``return_softmax_lse`` / ``return_attn_probs``) is a float32 array of the caller's
    kind equal to the reference's; ``return_attn_probs`` gives None in the place of the
    probabilities; an ``lse_out=`` given is written and returned."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    for options, takes_lse_out in LSE_OPTIONS[name]:
        call = CALLS[name](_rng(name, kind, sorted(options)), **options)
        expected = call.reference()
        args = device_args(call.args, kind)
        result = call.fn(**args)
        assert isinstance(result, tuple), f"{options} gave a {type(result).__name__}"
        assert len(result) == (3 if "return_attn_probs" in options else 2)
        lse = result[1]
        assert_kind(lse, kind, args[call.like])
        assert numpy_dtype(lse) == np.float32
        assert tuple(lse.shape) == expected[0][1].shape
        compare(call, fetch(call, result, args), expected)
        if takes_lse_out:
            args = device_args(call.args, kind)
            lse_out = empty_of_kind(args["q"], expected[0][1].shape, np.float32)
            result = call.fn(**args, lse_out=lse_out)
            assert data_ptr(result[1]) == data_ptr(lse_out), "the LSE returned is not lse_out's memory"
            compare(call, fetch(call, result, args), expected)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_func_lse_is_this_calls_over_many_calls(kind, request):
    """flash_attn_func's LSE equals the reference call after call, with fresh inputs each time.
    Regression of a fault found on the H200 (2026-12-03, benchmarks/lse_order_check.py): with torch
    tensors 3 of 300 and 9 of 400 calls returned an LSE that was not the call's (a permutation of
    an earlier call's values, or zeros) while the output was right; none with
    CUDA_LAUNCH_BLOCKING=1.  The cause: the LSE's transposing copy ran on ``ExternalStream(0)``, which
    torch makes a new pooled stream instead of the default stream (``_core.arrays.torch_stream``;
    benchmarks/NOTES_calls.md, fourteenth session)."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    for i in range(300):
        call = CALLS["func"](_rng("func many", kind, i), return_attn_probs=True)
        args = device_args(call.args, kind)
        compare(call, fetch(call, call.fn(**args), args), call.reference())


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_write_kv_cache_writes_are_seen_by_the_caller(kind, request):
    """write_kv_cache returns None and its writes show in the caller's own caches (read back
    through torch for torch caches)."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    call = CALLS["write_kv_cache"](_rng("write", kind))
    args = device_args(call.args, kind)
    result = call.fn(**args)
    compare(call, fetch(call, result, args), call.reference())


# --------------------------------------------------------------------------- streams

STREAM_MODES = ["torch-current", "torch-explicit", "cupy-current", "cupy-explicit", "cupy-int-handle"]


def side_stream(mode: str):
    """(handle, context making the stream current for its framework, call options) of ``mode``:
    ``current`` calls inside the context, the others pass ``stream=`` from outside it."""
    kind, how = mode.split("-", 1)
    if kind == "torch":
        import torch

        stream = torch.cuda.Stream()
        handle, context = stream.cuda_stream, functools.partial(torch.cuda.stream, stream)
    else:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        handle, context = stream.ptr, lambda: stream
    options = {"current": {}, "explicit": {"stream": stream}, "int-handle": {"stream": handle}}[how]
    return handle, context, options


@pytest.mark.parametrize("mode", STREAM_MODES)
@pytest.mark.parametrize("name", list(BUSY_CALLS))
def test_busy_side_stream_orders_the_call(name, mode, request):
    """A side stream sleeps on the GPU, then the inputs are written on it, the call is made on
    it (as the current stream, or through ``stream=``) and its result read on it at once: right
    in every round, and the kernels never met the poison the inputs held before."""
    kind = mode.split("-")[0]
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    call = BUSY_CALLS[name](_rng(name, mode))
    expected = call.reference()
    sources = device_args(call.args, kind)   # the right values
    targets = device_args(call.args, kind)   # what the call reads: poisoned before each round
    arrays = [n for n, value in call.args.items() if isinstance(value, np.ndarray)]
    handle, on_stream, options = side_stream(mode)
    inside = not options
    synchronize()  # the uploads (on the default stream) are done before the side stream reads them
    with on_stream():
        call.fn(**targets, **options)  # compiles, resolves the launch, sizes any workspace
    synchronize()
    for round_ in range(ROUNDS):
        for n in arrays:
            poison(targets[n])
        synchronize()
        with on_stream():
            sleep_on(handle, BUSY_SLEEP_S)
            for n in arrays:
                copy_into(targets[n], sources[n])
            if inside:
                result = call.fn(**targets)
        if not inside:
            result = call.fn(**targets, **options)
        with on_stream():
            fetched = fetch(call, result, targets)
        try:
            compare(call, fetched, expected)
        except AssertionError as error:
            raise AssertionError(f"round {round_}: {error}") from None
    assert cupy_paged.check_errors() is None, "a kernel read the poisoned inputs: it ran before they were written"


SLEEP_MODES = ["torch-side", "torch-default", "cupy-side", "cupy-null"]


@pytest.mark.parametrize("mode", SLEEP_MODES)
@pytest.mark.parametrize("name", list(CALLS))
def test_default_call_does_not_wait_for_its_stream(name, mode, request):
    """With the call's stream asleep on the GPU for 0.3 s, a (warm) default call returns while
    the sleep still runs: it synchronised with nothing.  Then its result is right."""
    if sanitizer_tool() == "initcheck":
        pytest.skip("compute-sanitizer's initcheck tracks each new allocation on the host, waiting for the GPU")
    kind, which = mode.split("-")
    if kind == "torch":
        torch = request.getfixturevalue("torch_cuda")
        stream = torch.cuda.Stream() if which == "side" else torch.cuda.default_stream()
        handle, on_stream = stream.cuda_stream, functools.partial(torch.cuda.stream, stream)
    else:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True) if which == "side" else cupy.cuda.Stream.null
        handle, on_stream = stream.ptr, lambda: stream
    call = CALLS[name](_rng(name, mode))
    expected = call.reference()
    args = device_args(call.args, kind)
    with on_stream():
        call.fn(**device_args(call.args, kind))  # warm: the kernels loaded, the launch resolved
    synchronize()
    import cupy

    with on_stream():
        sleep_on(handle, LONG_SLEEP_S)
        asleep = cupy.cuda.Event()
        asleep.record(cupy_stream(handle))
        start = time.perf_counter()
        result = call.fn(**args)
        seconds = time.perf_counter() - start
        still_asleep = not asleep.done
    assert still_asleep, f"the call returned only after its stream's sleep had ended ({seconds * 1e3:.1f} ms)"
    assert seconds < LONG_SLEEP_S / 3, f"the call took {seconds * 1e3:.1f} ms of host time"
    with on_stream():
        fetched = fetch(call, result, args)
    compare(call, fetched, expected)


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a default call used {what}")
    return refused


def _host_side(obj) -> bool:
    """Whether an argument of ``cupy.asarray`` / ``cupy.array`` lives on the host."""
    on_device = hasattr(obj, "__cuda_array_interface__") or (
        hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] in (2, 13))  # CUDA, CUDA managed
    return not on_device


@contextlib.contextmanager
def no_host_transfers_or_syncs(monkeypatch):
    """Every host-copy and synchronisation entry point of CuPy and torch raises while inside:
    the array methods that copy to the host, ``cupy.asarray``/``cupy.array`` of host data, the
    runtime's copies other than device to device, every stream, event and device sync, and
    torch's sync debug mode set to "error".  (Syncs made inside CuPy's compiled code, such as
    ``cupy.cuda.Device.synchronize``, cannot be patched: the sleeping-stream test catches those.)"""
    import cupy

    runtime = cupy.cuda.runtime
    with monkeypatch.context() as patch:
        patch.setattr(cupy, "asnumpy", _refuse("cupy.asnumpy"))
        for method in ("get", "set", "item", "tolist", "__int__", "__float__", "__bool__", "__complex__",
                       "__array__"):
            patch.setattr(cupy.ndarray, method, _refuse(f"cupy.ndarray.{method}"))
        for module_function in ("asarray", "array"):
            original = getattr(cupy, module_function)

            def device_only(obj, *args, _original=original, _name=module_function, **kwargs):
                if _host_side(obj):
                    raise AssertionError(f"a default call used cupy.{_name} on host data ({type(obj).__name__})")
                return _original(obj, *args, **kwargs)
            patch.setattr(cupy, module_function, device_only)
        for cls in (cupy.cuda.Stream, cupy.cuda.ExternalStream, cupy.cuda.Event):
            patch.setattr(cls, "synchronize", _refuse(f"cupy.cuda.{cls.__name__}.synchronize"))
        for function in ("deviceSynchronize", "streamSynchronize", "eventSynchronize", "memcpy", "memcpy2D",
                         "memcpy3D", "memcpy3DAsync"):
            patch.setattr(runtime, function, _refuse(f"cupy.cuda.runtime.{function}"))

        def device_to_device(original, kind_index, name):
            def copy(*args):
                if args[kind_index] != runtime.memcpyDeviceToDevice:
                    raise AssertionError(f"a default call used cupy.cuda.runtime.{name} of kind {args[kind_index]}")
                return original(*args)
            return copy
        patch.setattr(runtime, "memcpyAsync", device_to_device(runtime.memcpyAsync, 3, "memcpyAsync"))
        patch.setattr(runtime, "memcpy2DAsync", device_to_device(runtime.memcpy2DAsync, 6, "memcpy2DAsync"))
        torch = None
        import sys

        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            torch = sys.modules["torch"]
            patch.setattr(torch.cuda, "synchronize", _refuse("torch.cuda.synchronize"))
            for cls in (torch.cuda.Stream, torch.cuda.Event):
                patch.setattr(cls, "synchronize", _refuse(f"torch.cuda.{cls.__name__}.synchronize"))
            for method in ("item", "tolist", "cpu", "numpy"):
                patch.setattr(torch.Tensor, method, _refuse(f"torch.Tensor.{method}"))
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if torch is not None:
                torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("name", list(CALLS))
def test_default_call_makes_no_host_copy_and_no_sync(name, kind, request, monkeypatch):
    """After one eager call, a default call of the same shapes goes through none of the host-copy
    or sync entry points (they raise while it runs), and is right."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    call = CALLS[name](_rng(name, kind))
    call.fn(**device_args(call.args, kind))
    _right_without_host_transfers(call, kind, monkeypatch)


def _right_without_host_transfers(call: Call, kind: str, monkeypatch) -> None:
    """``call`` on fresh device arguments of ``kind``, every host-copy and sync entry point
    refused while it runs; its result and writes against the reference."""
    expected = call.reference()
    args = device_args(call.args, kind)
    synchronize()
    with no_host_transfers_or_syncs(monkeypatch):
        result = call.fn(**args)
    compare(call, fetch(call, result, args), expected)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_flash_attn_func_on_new_shapes_makes_no_host_copy_and_no_sync(kind, request, monkeypatch):
    """A generate loop's calls of ``flash_attn_func`` (Hugging Face's non-paged path): one query token
    over keys one longer each call, so every call's (batch, seqlen_k) is new.  Even a shape's first
    call goes through none of the host-copy or sync entry points (its cu_seqlens are made by a
    kernel on the call's stream), and each result is right."""
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    rng = _rng("func new shapes", kind)
    warm = func_call(rng)
    warm.fn(**device_args(warm.args, kind))  # kernels loaded, the error word made
    for seqlen_k in (91, 92, 93):
        call = Call(cupy_paged.flash_attn_func, dict(
            q=randn(rng, (2, 1, HEADS, DIM), F16), k=randn(rng, (2, seqlen_k, KV_HEADS, DIM), F16),
            v=randn(rng, (2, seqlen_k, KV_HEADS, DIM), F16), causal=True))
        _right_without_host_transfers(call, kind, monkeypatch)


@pytest.mark.parametrize("case", ["split workspace", "balanced work list"])
def test_a_first_call_on_a_new_stream_waits_for_no_other_stream(case, monkeypatch):
    """The buffers a launch keeps per stream (the split-KV workspace, the device list's buffer and
    merge counts) are made on the stream of the call that first needs them: that call, on a new
    stream, returns while another stream is still busy (no device sync), and is right."""
    import cupy

    from cupy_paged.api._call import MEMO
    from cupy_paged.kernels import ragged

    rng = _rng("new stream " + case, "cupy")
    if case == "balanced work list":
        monkeypatch.setattr(ragged, "BALANCE", True)
        MEMO.clear()
    call = decode_call(rng, num_splits=3 if case == "split workspace" else 0)
    call.fn(**device_args(call.args, "cupy"))  # kernels loaded, the error word made (on the null stream)
    args = device_args(call.args, "cupy")
    expected = call.reference()
    synchronize()
    busy, stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    sleep_on(busy.ptr, 2.0)
    busy_done = busy.record()
    try:
        with stream:
            result = call.fn(**args)
        assert not busy_done.done, "the first call on a new stream waited for another stream's work"
        stream.synchronize()
        compare(call, fetch(call, result, args), expected)
    finally:
        synchronize()
        MEMO.clear()


# --------------------------------------------------------------------------- CUDA graphs

def _replay_equals_eager(call: Call, static: dict, eager: dict, graph_result, replay, on_stream, rng) -> None:
    """``GRAPH_STEPS`` times: new input values into the captured arrays and into the eager ones,
    a replay, an eager call; the replay's result and writes equal the eager call's bitwise (and
    the first eager call equals the reference)."""
    for step in range(GRAPH_STEPS):
        new = call.next_values(rng, step)
        with on_stream():
            for name, value in new.items():
                assign(static[name], value)
                assign(eager[name], value)
            replay()
            eager_result = call.fn(**eager)
            synchronize()
            got, got_writes = fetch(call, graph_result, static)
            want, want_writes = fetch(call, eager_result, eager)
        if step == 0:
            compare(call, (want, want_writes), call.reference(**new))
        for i, (a, b) in enumerate(zip(got if isinstance(got, tuple) else (got,),
                                       want if isinstance(want, tuple) else (want,))):
            if b is not None:
                assert_same_bits(a, b, f"step {step}: replayed result {i}")
        for name in call.writes:
            assert_same_bits(got_writes[name], want_writes[name], f"step {step}: replayed {name}")


@pytest.mark.parametrize("name", list(CALLS))
def test_cuda_graph_of_a_default_call_cupy(name):
    """A default call with CuPy arrays captured on a CuPy stream (after one eager call on it):
    each replay with new input values equals an eager call."""
    import cupy

    rng = _rng(name, "graph-cupy")
    call = CALLS[name](rng)
    static, eager = device_args(call.args, "cupy"), device_args(call.args, "cupy")
    synchronize()  # uploaded on the null stream, read on a non-blocking one
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call.fn(**device_args(call.args, "cupy"))  # eager warm-up on the capturing stream
        stream.synchronize()
        stream.begin_capture()
        try:
            graph_result = call.fn(**static)
        finally:
            graph = stream.end_capture()
    _replay_equals_eager(call, static, eager, graph_result, lambda: graph.launch(stream=stream),
                         lambda: stream, rng)


@pytest.mark.parametrize("name", list(CALLS))
def test_cuda_graph_of_a_default_call_torch(name, torch_cuda):
    """A default call with torch tensors captured by ``torch.cuda.graph`` on a side stream (after
    one eager call on it): each replay with new input values equals an eager call."""
    torch = torch_cuda
    rng = _rng(name, "graph-torch")
    call = CALLS[name](rng)
    static, eager = device_args(call.args, "torch"), device_args(call.args, "torch")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call.fn(**device_args(call.args, "torch"))  # eager warm-up on the capturing stream
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        graph_result = call.fn(**static)
    _replay_equals_eager(call, static, eager, graph_result, graph.replay, contextlib.nullcontext, rng)


# --------------------------------------------------------------------------- hostile index values

GUARD_BLOCKS = 4   # guard blocks on each side of a cache
GUARD_ROWS = 64    # guard rows on each side of an output


@dataclasses.dataclass
class Hostile:
    """A call whose device index arrays hold one bad value (in sequence or token ``bad``).

    ``args`` are ready to pass (CuPy; caches and outputs are views inside guarded buffers, see
    ``guarded``); ``guards`` the (buffer, rows on each side, bits) whose guard rows must keep
    their bits; ``watched`` the arrays a rejected call must leave as they are; ``check_good``
    asserts the good sequences' part of a call's result; ``accepted`` the argument names the
    report may give."""

    fn: object
    args: dict
    bad: int
    accepted: tuple
    check_good: object
    guards: list = dataclasses.field(default_factory=list)
    watched: dict = dataclasses.field(default_factory=dict)


def guarded(value: np.ndarray, rows: int, guards: list):
    """A CuPy copy of ``value`` as a view inside a buffer ``rows`` longer on each side of axis 0,
    the extra rows NaN; the buffer goes into ``guards``."""
    import cupy

    buffer = cupy.empty((value.shape[0] + 2 * rows,) + value.shape[1:], value.dtype)
    bits = NAN_BITS[np.dtype(value.dtype)]
    buffer.view(np.uint16).fill(bits)
    view = buffer[rows:rows + value.shape[0]]
    view.set(np.ascontiguousarray(value))
    guards.append((buffer, rows, bits))
    return view


def assert_guards_intact(guards: list) -> None:
    for buffer, rows, bits in guards:
        whole = host(buffer).view(np.uint16)
        for side, part in (("before", whole[:rows]), ("after", whole[-rows:])):
            assert (part == bits).all(), f"a kernel wrote {int((part != bits).sum())} elements {side} an array"


def _nan_out(shape, dtype, guards):
    return guarded(np.full(shape, np.nan, np.float32).astype(dtype), GUARD_ROWS, guards)


def decode_hostile(variant: str) -> Hostile:
    """Four decode sequences (40, 17, 100 and 64 cached keys, one new token each, a shuffled
    table with one -1 column); ``variant`` spoils one of them."""
    import cupy

    rng = _rng("decode-hostile", variant)
    seqlens = np.array([40, 17, 100, 64], np.int32)
    table, num_blocks = shuffled_block_table(rng, seqlens + 1, BLOCK)  # blocks 3, 2, 7, 5; 8 columns
    batch = seqlens.size
    q = randn(rng, (batch, 1, HEADS, DIM), BF16)
    k_cache = randn(rng, (num_blocks, BLOCK, KV_HEADS, DIM), BF16)
    v_cache = randn(rng, (num_blocks, BLOCK, KV_HEADS, DIM), BF16)
    k_new, v_new = randn(rng, (batch, 1, KV_HEADS, DIM), BF16), randn(rng, (batch, 1, KV_HEADS, DIM), BF16)
    good_seqlens, good_table = seqlens.copy(), table.copy()
    bad, accepted = {
        "block-id-past-cache": (1, ("block_table",)),   # lands in the guard after the cache
        "block-id-far": (1, ("block_table",)),          # far outside: compute-sanitizer's case
        "block-id-minus-one": (2, ("block_table",)),    # lands in the guard before the cache
        "seqlens-past-table": (1, ("cache_seqlens", "block_table")),
        "negative-seqlens": (2, ("cache_seqlens",)),
    }[variant]
    if variant == "block-id-past-cache":
        table[1, 1] = num_blocks + 1          # sequence 1 needs columns 0 and 1
    elif variant == "block-id-far":
        table[1, 1] = 1_000_000
    elif variant == "block-id-minus-one":
        table[2, 3] = -1                      # sequence 2 needs columns 0 to 6
    elif variant == "seqlens-past-table":
        seqlens[1] = table.shape[1] * BLOCK + 5
    else:
        seqlens[2] = -5
    guards = []
    args = dict(q=cupy.asarray(q), k_cache=guarded(k_cache, GUARD_BLOCKS, guards),
                v_cache=guarded(v_cache, GUARD_BLOCKS, guards), k=cupy.asarray(k_new), v=cupy.asarray(v_new),
                cache_seqlens=cupy.asarray(seqlens), block_table=cupy.asarray(table), causal=True,
                out=_nan_out(q.shape, BF16, guards))
    good = [b for b in range(batch) if b != bad]
    # The bad sequence's own blocks may take its append; every other block must end as the
    # reference of the good sequences alone leaves it.
    own = table[bad][(table[bad] >= 0) & (table[bad] < num_blocks)]
    others = np.ones(num_blocks, bool)
    others[own] = False

    def check_good(result):
        ref_k, ref_v = k_cache.copy(), v_cache.copy()
        reference = cupy_paged.flash_attn_with_kvcache(q[good], ref_k, ref_v, k_new[good], v_new[good],
                                                      cache_seqlens=good_seqlens[good], block_table=good_table[good],
                                                      causal=True)
        out = host(result)
        assert_close(out[good], reference, BF16, what="the good sequences' out")
        assert not np.isnan(out[bad]).any(), "the bad sequence's out holds NaN (a hole was read)"
        assert_same_bits(host(args["k_cache"])[others], ref_k[others], "k_cache outside the bad sequence's blocks")
        assert_same_bits(host(args["v_cache"])[others], ref_v[others], "v_cache outside the bad sequence's blocks")

    watched = {name: args[name] for name in ("k_cache", "v_cache", "out")}
    return Hostile(cupy_paged.flash_attn_with_kvcache, args, bad, accepted, check_good, guards, watched)


def varlen_hostile(variant: str) -> Hostile:
    """Four causal varlen sequences (queries 20, 33, 7, 50 over keys 40, 33, 60, 50); ``variant``
    spoils one: cu_seqlens_k decreasing, cu_seqlens_q past q, or a block id of the paged form."""
    import cupy

    rng = _rng("varlen-hostile", variant)
    lens_q, lens_k = [20, 33, 7, 50], [40, 33, 60, 50]
    cu_q, _ = cupy_paged.cu_seqlens_from_lengths(lens_q)
    cu_k, _ = cupy_paged.cu_seqlens_from_lengths(lens_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    paged = variant.startswith("paged")
    bad, accepted = {"cu-k-decreasing": (1, ("cu_seqlens_k",)), "cu-q-past-q": (3, ("cu_seqlens_q",)),
                     "paged-block-id-past-cache": (1, ("block_table",)),
                     "paged-block-id-far": (1, ("block_table",))}[variant]
    if variant == "cu-k-decreasing":
        cu_k = np.array([0, 40, 30, 90, 140], np.int32)  # sequence 1 ends before it starts; 2 and 3 are fine
        total_k = 140
    elif variant == "cu-q-past-q":
        cu_q = cu_q.copy()
        cu_q[4] = total_q + 30                           # sequence 3 runs 30 rows past q
    good = [b for b in range(len(lens_q)) if b != bad]
    q_ranges = [(int(cu_q[b]), int(cu_q[b + 1])) for b in good]
    k_ranges = [(int(cu_k[b]), int(cu_k[b + 1])) for b in good]
    max_q = max(e - s for s, e in q_ranges)
    max_k = max(e - s for s, e in k_ranges)
    q = randn(rng, (total_q, HEADS, DIM), BF16)
    k = randn(rng, (total_k, KV_HEADS, DIM), BF16)
    v = randn(rng, (total_k, KV_HEADS, DIM), BF16)
    guards = []
    args = dict(q=cupy.asarray(q), cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k),
                max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True, out=_nan_out(q.shape, BF16, guards))
    if paged:
        (k_cache, v_cache), table = scatter_paged(rng, [k, v], lens_k, BLOCK)
        good_table = table[good]
        table[1, 1] = k_cache.shape[0] + 1 if variant.endswith("past-cache") else 1_000_000
        args.update(k=guarded(k_cache, GUARD_BLOCKS, guards), v=guarded(v_cache, GUARD_BLOCKS, guards),
                    block_table=cupy.asarray(table))
    else:
        args.update(k=cupy.asarray(k), v=cupy.asarray(v))

    def check_good(result):
        good_q = np.concatenate([q[s:e] for s, e in q_ranges])
        cu_good_q, _ = cupy_paged.cu_seqlens_from_lengths([e - s for s, e in q_ranges])
        cu_good_k, _ = cupy_paged.cu_seqlens_from_lengths([e - s for s, e in k_ranges])
        if paged:
            reference = cupy_paged.flash_attn_varlen_func(good_q, k_cache, v_cache, cu_good_q, cu_good_k, max_q,
                                                         max_k, causal=True, block_table=good_table)
        else:
            good_k = np.concatenate([k[s:e] for s, e in k_ranges])
            good_v = np.concatenate([v[s:e] for s, e in k_ranges])
            reference = cupy_paged.flash_attn_varlen_func(good_q, good_k, good_v, cu_good_q, cu_good_k, max_q,
                                                         max_k, causal=True)
        out = host(result)
        assert_close(np.concatenate([out[s:e] for s, e in q_ranges]), reference, BF16,
                     what="the good sequences' out")
        if paged:  # a block-table hole is masked: the bad sequence's rows are still computed
            rows = out[int(cu_q[bad]):int(cu_q[bad + 1])]
            assert not np.isnan(rows).any(), "the bad sequence's out holds NaN (a hole was read)"

    watched = {"out": args["out"]}
    return Hostile(cupy_paged.flash_attn_varlen_func, args, bad, accepted, check_good, guards, watched)


def write_hostile(variant: str) -> Hostile:
    """37 tokens into 6 blocks of 16 slots; token 7's slot is past the cache (in the guard after
    it), or far past it."""
    import cupy

    rng = _rng("write-hostile", variant)
    shape = (6, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = randn(rng, shape, BF16), randn(rng, shape, BF16)
    k, v = randn(rng, (37, KV_HEADS, DIM), BF16), randn(rng, (37, KV_HEADS, DIM), BF16)
    slots = _slots(rng, shape, 37)
    bad = 7
    good_slots = slots.copy()
    good_slots[bad] = -1
    slots[bad] = shape[0] * BLOCK + 3 if variant == "slot-past-cache" else 2 ** 31 - 1
    guards = []
    args = dict(k_cache=guarded(k_cache, GUARD_BLOCKS, guards), v_cache=guarded(v_cache, GUARD_BLOCKS, guards),
                k=cupy.asarray(k), v=cupy.asarray(v), slot_mapping=cupy.asarray(slots))

    def check_good(result):
        assert result is None
        ref_k, ref_v = k_cache.copy(), v_cache.copy()
        cupy_paged.write_kv_cache(ref_k, ref_v, k, v, good_slots)
        assert_same_bits(host(args["k_cache"]), ref_k, "k_cache")
        assert_same_bits(host(args["v_cache"]), ref_v, "v_cache")

    watched = {name: args[name] for name in ("k_cache", "v_cache")}
    return Hostile(cupy_paged.write_kv_cache, args, bad, ("slot_mapping",), check_good, guards, watched)


HOSTILE = {
    **{f"decode-{v}": functools.partial(decode_hostile, v) for v in
       ("block-id-past-cache", "block-id-far", "block-id-minus-one", "seqlens-past-table", "negative-seqlens")},
    **{f"varlen-{v}": functools.partial(varlen_hostile, v) for v in
       ("cu-k-decreasing", "cu-q-past-q", "paged-block-id-past-cache", "paged-block-id-far")},
    **{f"write-{v}": functools.partial(write_hostile, v) for v in ("slot-past-cache", "slot-far")},
}


def assert_reported(accepted: tuple, index: int) -> None:
    """check_errors() raises a ValueError naming one of ``accepted`` and sequence (or token)
    ``index``, and is clear after it."""
    with pytest.raises(ValueError) as info:
        cupy_paged.check_errors()
    message = str(info.value)
    assert any(name in message for name in accepted), f"the report names none of {accepted}: {message}"
    assert re.search(rf"\b(sequence|token) {index}\b", message), f"the report does not name {index}: {message}"
    assert cupy_paged.check_errors() is None, "check_errors() did not clear the report"


@pytest.mark.parametrize("variant", list(HOSTILE))
def test_sanitize_hostile_values_are_holes_and_reported(variant):
    """Default call (check_values not given) on a bad device index value: the good sequences
    equal the reference on them alone, nothing outside the arrays is written, and check_errors()
    names the argument and the sequence, once."""
    case = HOSTILE[variant]()
    result = case.fn(**case.args)
    synchronize()
    case.check_good(result)
    assert_guards_intact(case.guards)
    assert_reported(case.accepted, case.bad)


@pytest.mark.parametrize("variant", list(HOSTILE))
def test_check_values_rejects_hostile_values_before_any_work(variant):
    """check_values=True: a ValueError naming the argument, and no work done (caches and out as
    they were, no report in the error word)."""
    case = HOSTILE[variant]()
    before = {name: host(array) for name, array in case.watched.items()}
    with pytest.raises(ValueError) as info:
        case.fn(**case.args, check_values=True)
    assert any(name in str(info.value) for name in case.accepted), str(info.value)
    for name, array in case.watched.items():
        assert_same_bits(host(array), before[name], f"{name} after a rejected call")
    assert_guards_intact(case.guards)
    assert cupy_paged.check_errors() is None


def test_sanitize_debug_mode_raises_at_the_call():
    """set_debug(True): the call that met a bad value raises it itself, and the report is cleared."""
    case = HOSTILE["decode-block-id-minus-one"]()
    cupy_paged.set_debug(True)
    with pytest.raises(ValueError, match="block_table"):
        case.fn(**case.args)
    cupy_paged.set_debug(False)
    assert cupy_paged.check_errors() is None


# The valid value each wrongly typed one below equals.
_GOOD_SCALAR = dict(window_size=(8, 0), softmax_scale=1.0, softcap=0.0, dropout_p=0.0)


@pytest.mark.parametrize("name", ["varlen", "varlen_paged", "decode"])
@pytest.mark.parametrize("bad", [dict(causal=1), dict(window_size=(8.0, 0)), dict(softmax_scale=True),
                                 dict(softcap=False), dict(dropout_p=False)], ids=str)
def test_a_memoised_call_still_refuses_a_wrongly_typed_equal_scalar(name, bad):
    """After a valid call (memoised), ``causal=1``, ``window_size=(8.0, 0)``, ``softmax_scale=True``,
    ``softcap=False`` or ``dropout_p=False`` -- equal to the valid ``True``, ``(8, 0)``, ``1.0``, ``0.0``
    -- is refused with a TypeError naming the argument, as on a first call."""
    argument = next(iter(bad))
    if argument == "dropout_p" and name == "decode":
        pytest.skip("flash_attn_with_kvcache has no dropout_p")
    rng = _rng(name, "memo-types")
    call = CALLS[name](rng)
    args = device_args(call.args, "cupy")
    good = dict(args, **{argument: _GOOD_SCALAR[argument]}) if argument in _GOOD_SCALAR else args
    call.fn(**good)
    call.fn(**good)  # memoised now
    with pytest.raises(TypeError, match=argument):
        call.fn(**dict(good, **bad))
