"""The host side of two call contracts, without a GPU: which stream a ``stream=`` argument names
(``cupy_paged._core.streams.handle``) and how per-stream state tells streams apart
(``stream_key``), and the debug switch of the device error word
(``set_debug`` and ``CUPY_PAGED_DEBUG`` read at import)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import cupy_paged
from cupy_paged._core import errors
from cupy_paged._core.arrays import CUPY, TORCH
from cupy_paged._core.streams import handle, stream_key


class _Protocol:
    """An object with ``__cuda_stream__`` as a method or as an attribute."""

    def __init__(self, value, as_method: bool = True):
        if as_method:
            self.__cuda_stream__ = lambda: value
        else:
            self.__cuda_stream__ = value


class _Attribute:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


@pytest.mark.parametrize("kind", [CUPY, TORCH])
@pytest.mark.parametrize("stream,expected", [
    (0, 0),
    (12345, 12345),
    (_Protocol((0, 777)), 777),          # the protocol's (version, handle) pair
    (_Protocol(778), 778),               # a bare handle
    (_Protocol((0, 779), as_method=False), 779),
    (_Attribute(ptr=880), 880),          # a CuPy stream
    (_Attribute(cuda_stream=881), 881),  # a torch stream
], ids=["int-0", "int", "protocol-pair", "protocol-int", "protocol-attribute", "cupy-like", "torch-like"])
def test_stream_argument_forms_name_their_handle(stream, expected, kind):
    """Every documented form of ``stream=`` gives its ``cudaStream_t``, whatever the arrays' kind."""
    assert handle(stream, kind, 0) == expected


@pytest.mark.parametrize("stream,error,match", [
    (True, TypeError, "stream must be a stream handle"),
    (-1, ValueError, "non-negative"),
    (_Protocol((0, -5)), TypeError, "__cuda_stream__"),
    (_Protocol("7"), TypeError, "__cuda_stream__"),
    (_Protocol(True), TypeError, "__cuda_stream__"),
    (object(), TypeError, "stream must be an int handle"),
    (1.5, TypeError, "stream must be"),
])
def test_bad_stream_arguments_are_refused_naming_stream(stream, error, match):
    with pytest.raises(error, match=match):
        handle(stream, CUPY, 0)


def _debug_at_import(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CUPY_PAGED_DEBUG"}
    if value is not None:
        env["CUPY_PAGED_DEBUG"] = value
    done = subprocess.run([sys.executable, "-c", "from cupy_paged._core.errors import debug; print(debug())"],
                          env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), (None, False)], ids=["1", "0", "unset"])
def test_environment_variable_turns_the_debug_switch_on_at_import(value, on):
    assert _debug_at_import(value) == str(on)


def test_set_debug_takes_a_bool_only():
    before = errors.debug()
    try:
        cupy_paged.set_debug(True)
        assert errors.debug() is True
        cupy_paged.set_debug(False)
        assert errors.debug() is False
        with pytest.raises(TypeError, match="flag must be a bool"):
            cupy_paged.set_debug("yes")
        with pytest.raises(TypeError, match="flag must be a bool"):
            cupy_paged.set_debug(1)
    finally:
        errors.set_debug(before)


def test_check_errors_with_nothing_recorded_returns_none():
    assert cupy_paged.check_errors() is None


def test_stream_key_tells_each_threads_per_thread_stream_apart():
    """cudaStreamPerThread (handle 2) is a different stream in each host thread: its per-stream
    buffers are keyed by thread too, so two threads never share a work list or workspace.  Every
    other handle (the legacy default stream 0 and 1, created streams) is one stream for all threads."""
    keys = {}
    both_alive = threading.Barrier(2)  # a thread's ident may be reused once it has ended

    def record(name, wait=True):
        keys[name] = (stream_key(2), stream_key(0), stream_key(1), stream_key(0x7f00deadbeef))
        if wait:
            both_alive.wait(timeout=30)

    threads = [threading.Thread(target=record, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record("main", wait=False)
    per_thread = {name: k[0] for name, k in keys.items()}
    assert len(set(per_thread.values())) == 3, per_thread
    assert all(key[0] == 2 for key in per_thread.values())
    assert {k[1:] for k in keys.values()} == {(0, 1, 0x7f00deadbeef)}
