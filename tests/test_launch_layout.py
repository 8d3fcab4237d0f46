"""Each launcher's packed argument layout matches its kernel's parameter list in cuda_src/.

The launches pack every argument into one buffer (ops/_common.Launcher), so a layout that drifts
from the kernel's signature would pass garbage to the GPU; this reads the signatures from the
source and compares them with the layouts, parameter by parameter, without a GPU.
"""
import re
import struct

import pytest

from cupy_paged._core.compiler import load_source
from cupy_paged.kernels import decode, kv_write, varlen, varlen_wgmma

# C parameter type -> struct code of the same size and alignment.
CODES = {"int": "i", "long long": "q", "float": "f", "unsigned": "I"}


def parameters(source: str, kernel: str) -> list[str]:
    """The parameter declarations of ``kernel`` in ``source`` (macros of the varlen kernels expanded)."""
    text = load_source(source)
    if kernel in ("varlen_fwd", "varlen_fwd_wgmma"):
        match = re.search(r"#define VARLEN_FWD_PARAMS(.*?)\n#define", text, re.S)
        body = match.group(1)
    else:
        match = re.search(rf"{kernel}\((.*?)\)\s*{{", text, re.S)
        body = match.group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    body = re.sub(r"//[^\n]*", "", body).replace("\\\n", " ")
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


@pytest.mark.parametrize("source, kernel, layout", [
    (decode.SOURCE, "paged_decode", f"{struct.calcsize('<' + decode._PARAMS_LAYOUT)}s" + decode._DECODE_LAYOUT[len(decode._PARAMS_LAYOUT):]),
    (decode.SOURCE, "combine_splits", decode._COMBINE_LAYOUT),
    (varlen.SOURCE, "varlen_fwd", varlen._LAYOUT),
    (varlen_wgmma.SOURCE, "varlen_fwd_wgmma", varlen._LAYOUT),
    (kv_write.SOURCE, "write_kv_cache", kv_write._LAYOUT),
])
def test_layout_matches_the_kernel_signature(source, kernel, layout):
    expected = [code_of(p) for p in parameters(source, kernel)]
    assert expand(layout) == expected, f"{kernel}: layout {layout} against the signature {expected}"


def test_decode_params_struct_size():
    """DecodeParams is 160 bytes (decode.cu's static_assert) and 8-aligned, so the pointers after
    it need no padding."""
    assert struct.calcsize("<" + decode._PARAMS_LAYOUT) == 160
    assert struct.calcsize("@" + decode._PARAMS_LAYOUT) == 160


class _FakeFunction:
    ptr = 0  # never launched: only the packing is tested


@pytest.mark.parametrize("layout", [decode._DECODE_LAYOUT, decode._COMBINE_LAYOUT, varlen._LAYOUT, kv_write._LAYOUT])
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
