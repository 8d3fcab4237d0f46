"""Llama weights: random from a seed, or read from / written to a Hugging Face checkpoint folder.

Weights travel as a dict of NumPy arrays under Hugging Face's names and layouts (a linear layer's
``weight`` is ``[out_features, in_features]``); :class:`llama.model.LlamaModel` turns them into
its own layout on its device.  A checkpoint folder is ``config.json`` plus either one
``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` listed by
``model.safetensors.index.json``.

bfloat16: safetensors' NumPy side reads a ``BF16`` tensor through ``numpy.dtype("bfloat16")``,
which exists only once ``ml_dtypes`` is imported (0.8.0 does; its ``load(bytes)`` path has no
BF16 at all and older releases refuse BF16 for NumPy).  So ``ml_dtypes`` is imported first, and
when the package still refuses a tensor, its bytes are read straight from the file (the format
is an 8-byte header length, a JSON header, then raw little-endian data).
"""
from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from .config import LlamaConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_RAW_DTYPES = {"BF16": BF16, "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}


def parameter_shapes(config: LlamaConfig) -> dict:
    """Every parameter's Hugging Face name and shape (``lm_head.weight`` only when untied)."""
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h), p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h), p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(config: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Random weights with unit-scale activations, so that the logits depend on the context.

    Linear layers draw from N(0, 1 / in_features), embeddings from N(0, 1), norm weights near 1.

    Returns
    -------
    dict
        name -> C-contiguous NumPy array of ``dtype`` (shapes of :func:`parameter_shapes`).

    Examples
    --------
    >>> from llama.config import CPU_DEFAULT
    >>> w = random_weights(CPU_DEFAULT, seed=1)
    >>> w["model.layers.0.self_attn.k_proj.weight"].shape
    (64, 128)
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in parameter_shapes(config).items():
        if len(shape) == 1:
            values = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            scale = 1.0 if name == "model.embed_tokens.weight" else 1.0 / np.sqrt(shape[1])
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        out[name] = np.ascontiguousarray(values.astype(dtype))
    return out


def _shards(weights: dict, max_shard_bytes: int | None) -> list[dict]:
    """Split ``weights`` (in order) into dicts of at most ``max_shard_bytes`` each (one if None)."""
    if max_shard_bytes is None:
        return [dict(weights)]
    shards, current, size = [], {}, 0
    for name, array in weights.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    return shards + ([current] if current else [])


def save_checkpoint(folder, config: LlamaConfig, weights: dict, dtype=None, max_shard_bytes: int | None = None):
    """Write a Hugging Face checkpoint folder: ``config.json`` and safetensors file(s).

    Parameters
    ----------
    folder : path
        Created if missing.
    weights : dict
        Hugging Face names -> arrays (e.g. :func:`random_weights`).
    dtype : dtype, optional
        Cast every tensor to this (bfloat16, float16, float32); default: as given.
    max_shard_bytes : int, optional
        Shard into files of at most this size with an index; default one ``model.safetensors``.
    """
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(a if dtype is None else a.astype(dtype)) for name, a in weights.items()}
    first = next(iter(arrays.values()))
    config.save(folder, torch_dtype="bfloat16" if first.dtype == BF16 else first.dtype.name)
    shards = _shards(arrays, max_shard_bytes)
    if max_shard_bytes is None:
        save_file(arrays, str(folder / SINGLE_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(a.nbytes for a in arrays.values())
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")


def read_raw(path, names=None) -> dict:
    """Tensors of one safetensors file read from its bytes (no safetensors package): the fallback
    for a package that refuses BF16 for NumPy.  ``names`` limits which (default all)."""
    path = pathlib.Path(path)
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        if entry["dtype"] not in _RAW_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has dtype {entry['dtype']}, not a float type")
        start, stop = entry["data_offsets"]
        raw = np.array(data[start:stop])  # a copy: the file may close or change afterwards
        out[name] = raw.view(_RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return out


def _read_file(path, names) -> dict:
    """The tensors ``names`` of one safetensors file, through the safetensors package."""
    from safetensors import safe_open

    out, refused = {}, []
    with safe_open(str(path), framework="np") as f:
        for name in names:
            try:
                out[name] = f.get_tensor(name)
            except (TypeError, KeyError, ValueError):  # a release whose NumPy side lacks BF16
                refused.append(name)
    if refused:
        out.update(read_raw(path, set(refused)))
    return out


def _files_of(folder: pathlib.Path) -> dict:
    """file name -> the tensor names it holds, from the index or the one file's header."""
    index = folder / INDEX_NAME
    if index.exists():
        files: dict = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    single = folder / SINGLE_NAME
    if not single.exists():
        found = sorted(folder.glob("*.safetensors"))
        if len(found) != 1:
            raise FileNotFoundError(f"{folder}: no {INDEX_NAME} and not exactly one *.safetensors file")
        single = found[0]
    from safetensors import safe_open

    with safe_open(str(single), framework="np") as f:
        return {single.name: list(f.keys())}


def load_checkpoint(folder, dtype=None) -> tuple[LlamaConfig, dict]:
    """Read a Hugging Face Llama checkpoint folder.

    Parameters
    ----------
    folder : path
        Holds ``config.json`` and the safetensors file(s), sharded with an index or not.
    dtype : dtype, optional
        Cast every tensor to this; default: as stored.

    Returns
    -------
    (LlamaConfig, dict)
        The config and name -> NumPy array, exactly the names of :func:`parameter_shapes`
        (tensors the forward pass does not read, such as ``rotary_emb.inv_freq``, are dropped).

    Raises
    ------
    ValueError
        A parameter missing or of the wrong shape for the config.
    """
    folder = pathlib.Path(folder)
    config = LlamaConfig.load(folder)
    shapes = parameter_shapes(config)
    weights = {}
    for file, names in _files_of(folder).items():
        wanted = [n for n in names if n in shapes]
        for name, array in _read_file(folder / file, wanted).items():
            weights[name] = array if dtype is None else array.astype(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing = [n for n in shapes if n not in weights]
    wrong = [f"{n} {weights[n].shape} (want {s})" for n, s in shapes.items() if n in weights and weights[n].shape != s]
    if missing or wrong:
        raise ValueError(f"{folder}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}; wrong shapes {wrong[:5]}")
    return config, {n: weights[n] for n in shapes}
