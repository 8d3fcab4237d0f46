"""Each launcher's packed argument layout matches its kernel's parameter list in cuda_src/.

The launches pack every argument into one buffer (kernels/_launch.Launcher), so a layout that
drifts from the kernel's signature would pass garbage to the GPU; this reads the signatures from
the source and compares them with the layouts, parameter by parameter, without a GPU.  A
parameter under ``#if MACRO`` (paged_decode's trace buffer, ``TRACE``) counts only in the
specialization that sets the macro.
"""
import re
import struct

import numpy as np
import pytest

from cupy_paged._core.compiler import load_source
from cupy_paged.kernels import decode, kv_write, ragged, varlen, varlen_wgmma

# C parameter type -> struct code of the same size and alignment.
CODES = {"int": "i", "long long": "q", "float": "f", "unsigned": "I"}


def parameters(source: str, kernel: str, macros: frozenset = frozenset()) -> list[str]:
    """The parameter declarations of ``kernel`` in ``source`` (macros of the varlen kernels
    expanded; a ``#if NAME`` ... ``#endif`` block kept when NAME is in ``macros``, else dropped)."""
    text = load_source(source)
    if kernel in ("varlen_fwd", "varlen_fwd_wgmma"):
        match = re.search(r"#define VARLEN_FWD_PARAMS(.*?)\n#define", text, re.S)
        # the TRACE specialization's trace buffer, last (VARLEN_TRACE_PARAM, varlen_common.cuh)
        body = match.group(1).replace("VARLEN_TRACE_PARAM", ", unsigned long long* trace" if "TRACE" in macros else "")
    else:
        match = re.search(rf"{kernel}\((.*?)\)\s*{{", text, re.S)
        body = match.group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    body = re.sub(r"//[^\n]*", "", body).replace("\\\n", " ")
    body = re.sub(r"#if (\w+)\n(.*?)#endif", lambda m: m.group(2) if m.group(1) in macros else "", body, flags=re.S)
    assert "#" not in body, f"{kernel}: a preprocessor line this test does not read"
    return [p.strip() for p in body.split(",") if p.strip()]


def code_of(declaration: str) -> str:
    if "*" in declaration:
        return "P"
    if "DecodeParams" in declaration:
        return f"{struct.calcsize('<' + decode._PARAMS_LAYOUT)}s"
    words = declaration.replace("const", "").split()
    return CODES[" ".join(words[:-1])]


def expand(layout: str) -> list[str]:
    """``"9P2i"`` -> ``["P"] * 9 + ["i"] * 2``; a struct (``160s``) stays one entry."""
    out = []
    for count, code in re.findall(r"(\d*)([a-zA-Z])", layout):
        if code == "s":
            out.append(f"{count}s")
        else:
            out.extend([code] * int(count or 1))
    return out


def _decode_layout(layout: str) -> str:
    """paged_decode's layout with DecodeParams as one struct entry, as the signature reads."""
    return f"{struct.calcsize('<' + decode._PARAMS_LAYOUT)}s" + layout[len(decode._PARAMS_LAYOUT):]


@pytest.mark.parametrize("source, kernel, macros, layout", [
    (decode.SOURCE, "paged_decode", frozenset(), _decode_layout(decode._DECODE_LAYOUT)),
    (decode.SOURCE, "paged_decode", frozenset({"TRACE"}), _decode_layout(decode._TRACE_LAYOUT)),
    (decode.SOURCE, "combine_splits", frozenset(), decode._COMBINE_LAYOUT),
    (varlen.SOURCE, "varlen_fwd", frozenset(), varlen._LAYOUT),
    (varlen_wgmma.SOURCE, "varlen_fwd_wgmma", frozenset(), varlen._LAYOUT),
    (varlen_wgmma.SOURCE, "varlen_fwd_wgmma", frozenset({"TRACE"}), varlen._LAYOUT + "P"),
    (kv_write.SOURCE, "write_kv_cache", frozenset(), kv_write._LAYOUT),
    (decode.SOURCE, "paged_decode", frozenset({"RAGGED"}), _decode_layout(ragged._RAGGED_LAYOUT)),
    (decode.SOURCE, "paged_decode", frozenset({"RAGGED", "TRACE"}), _decode_layout(ragged._RAGGED_LAYOUT + "P")),
], ids=["paged_decode", "paged_decode-TRACE", "combine_splits", "varlen_fwd", "varlen_fwd_wgmma",
        "varlen_fwd_wgmma-TRACE", "write_kv_cache",
        "paged_decode-RAGGED", "paged_decode-RAGGED-TRACE"])
def test_layout_matches_the_kernel_signature(source, kernel, macros, layout):
    expected = [code_of(p) for p in parameters(source, kernel, macros)]
    assert expand(layout) == expected, f"{kernel}: layout {layout} against the signature {expected}"


def test_registered_decode_keys_take_no_trace():
    """The trace buffer belongs to the benchmark's TRACE keys only: no registered key sets TRACE,
    and the launch of a registered key packs no trace pointer."""
    assert all("TRACE" not in dict(key.params) for key in decode.all_keys())
    assert "TRACE" in dict(decode.kernel_key(np.float16, 128, trace=True).params)
    assert decode._TRACE_LAYOUT == decode._DECODE_LAYOUT + "P"


def test_decode_params_struct_size():
    """DecodeParams is 160 bytes (decode.cu's static_assert) and 8-aligned, so the pointers after
    it need no padding."""
    assert struct.calcsize("<" + decode._PARAMS_LAYOUT) == 160
    assert struct.calcsize("@" + decode._PARAMS_LAYOUT) == 160


class _FakeFunction:
    ptr = 0  # never launched: only the packing is tested


@pytest.mark.parametrize("layout", [decode._DECODE_LAYOUT, decode._TRACE_LAYOUT, decode._COMBINE_LAYOUT, varlen._LAYOUT,
                                    kv_write._LAYOUT, ragged._RAGGED_LAYOUT])
def test_spans_rewrite_exactly_their_fields(layout):
    """Rewriting a span (what a launch does with its pointers) gives the bytes of packing the
    whole list with those values: every span's offset is its field's offset in the buffer."""
    from cupy_paged.kernels._launch import Launcher

    launcher = Launcher(_FakeFunction(), layout)
    codes = launcher._codes
    base = [1.5 if c == "f" else (b"\x07" * int(c[:-1]) if c.endswith("s") else 3) for c in codes]
    for first in range(len(codes)):
        for count in (1, len(codes) - first):
            changed = list(base)
            for i in range(first, first + count):
                changed[i] = 2.25 if codes[i] == "f" else (b"\x09" * int(codes[i][:-1]) if codes[i].endswith("s") else 1000 + i)
            launcher.pack(*base)
            span, offset = launcher.span(first, count)
            span.pack_into(launcher._buffer, offset, *changed[first:first + count])
            expected = struct.Struct("@" + layout).pack(*changed)
            assert bytes(launcher._buffer[:len(expected)]) == expected, (first, count)


def test_device_list_constants_match_the_kernel_source():
    """The device list's rule constants (decode.cu) are kernels/ragged.py's, which the host list uses."""
    source = load_source(decode.SOURCE)
    found = {name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", source)}
    assert (found["kListMinTiles"], found["kListWaves"], found["kMaxSplits"], found["kRows"]) == (
        ragged.MIN_SPLIT_TILES, ragged.WAVES, ragged.MAX_SPLITS, ragged.ROWS)


def binary_parameters(cubin: bytes, kernel: str) -> list[tuple[int, int]]:
    """``(offset, size)`` of each parameter of ``kernel`` as its cubin records them (the
    ``EIATTR_KPARAM_INFO`` entries of ``.nv.info.<kernel>``): where the driver puts each argument of
    a launch by parameter pointers, and where a launch by buffer must have put it."""
    section_at = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_at + i * entry_size) for i in range(count)]
    names = sections[names_index][4]

    def name(offset):
        return cubin[names + offset:cubin.index(b"\0", names + offset)].decode()

    (info,) = [s for s in sections if name(s[0]) == f".nv.info.{kernel}"]
    body, found, i = cubin[info[4]:info[4] + info[5]], {}, 0
    while i < len(body):
        form, attribute = body[i], body[i + 1]
        if form != 4:  # EIFMT_SVAL carries a 16-bit size; the others' values are 0 or 2 bytes long
            i += 2 if form == 1 else 4
            continue
        size = struct.unpack_from("<H", body, i + 2)[0]
        if attribute == 0x17:  # EIATTR_KPARAM_INFO: index, ordinal, offset, flags (size in bits 18..31)
            _, ordinal, offset, flags = struct.unpack_from("<IHHI", body, i + 4)
            found[ordinal] = (offset, flags >> 18)
        i += 4 + size
    return [found[o] for o in range(len(found))]


def test_launch_buffers_are_the_binary_parameter_layout():
    """A launch by buffer hands the kernel its C layout, so every kernel launched so must record
    exactly that layout in its binary; the TMA shape's 64-byte aligned maps move its parameters 48
    bytes on (sm_90), so its launcher goes by parameter pointers, each at its argument's place in
    the buffer.  Read from cubins NVRTC builds without a GPU (the registered wgmma shape and the TMA
    candidate, D = 64, and the decode kernel with its 160-byte parameter struct)."""
    from cupy_paged._core.nvrtc import nvrtc_compile
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels._launch import Launcher

    tma_tiles = varlen_wgmma.WgmmaTiles(128, 2, producer=True, tma=True)
    cases = [(varlen.specialization(BF16, 64, varlen_wgmma.WGMMA_TILES[64]), varlen._LAYOUT, False),
             (varlen.specialization(BF16, 64, tma_tiles), "256s" + varlen._LAYOUT, True),
             # DecodeParams is one parameter of the kernel, its fields one struct entry here
             ((decode.kernel_key(BF16, 128), "paged_decode"), _decode_layout(decode._DECODE_LAYOUT), False)]
    for (key, kernel), layout, pointers in cases:
        recorded = binary_parameters(nvrtc_compile(key, "sm_90a" if "wgmma" in key.source else "sm_90")[1], kernel)
        launcher = Launcher(_FakeFunction(), layout, param_pointers=pointers)
        c_layout = [(launcher._offset(i), struct.calcsize("@" + code)) for i, code in enumerate(launcher._codes)]
        assert [size for _, size in recorded] == [size for _, size in c_layout], key
        if not pointers:
            assert recorded == c_layout, f"{key}: a launch by buffer would misplace its arguments"
            assert launcher._kernel_params == 0 and launcher._extra_ptr != 0
        else:
            assert recorded[0][0] == 48 and recorded != c_layout, key
            assert launcher._extra_ptr == 0 and list(launcher._params) == [
                launcher._buffer.ctypes.data + offset for offset, _ in c_layout]
