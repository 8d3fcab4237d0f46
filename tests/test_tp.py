"""Tensor parallelism of the example engine on the CPU backend: two processes, a socket group.

Greedy tokens of a two-rank run (heads and MLP split, all-reduces over sockets, rank 0 scheduling
and broadcasting each plan) equal the one-process run's for the first 16 tokens of every request
in float32; the shards' shapes and the launcher's environment are checked too.
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from llama import Engine, GenerationRequest, LlamaModel, random_weights  # noqa: E402
from llama.config import LlamaConfig  # noqa: E402
from llama.parallel import launch_local, ranks_from_environment, shard, SocketGroup  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10000.0,
                     max_position_embeddings=512)
NEW_TOKENS = 16


def requests():
    rng = np.random.default_rng(4)
    return [GenerationRequest(i, rng.integers(0, CONFIG.vocab_size, int(n)).tolist(), NEW_TOKENS)
            for i, n in enumerate([5, 40, 17, 64, 3, 29])]


def engine_kwargs():
    return dict(block_size=8, num_blocks=96, max_batch_tokens=48, max_num_seqs=4)


def _rank(tp: int, out_path: str) -> int:
    """One rank of the two-process run (a module-level function: the spawned process imports it)."""
    group = SocketGroup(ranks_from_environment())
    config, weights = shard(CONFIG, random_weights(CONFIG, 3, np.float32), group.rank, tp)
    engine = Engine(LlamaModel(config, weights, np, np.float32), group=group, **engine_kwargs())
    if group.rank > 0:
        engine.follow()
        return 0
    outputs = engine.run(requests())
    engine.stop_followers()
    pathlib.Path(out_path).write_text(json.dumps({str(k): v for k, v in outputs.items()}))
    return 0


def test_two_ranks_generate_the_tokens_of_one(tmp_path):
    alone = Engine(LlamaModel(CONFIG, random_weights(CONFIG, 3, np.float32), np, np.float32), **engine_kwargs())
    want = {str(k): v for k, v in alone.run(requests()).items()}
    out = tmp_path / "tp2.json"
    assert launch_local(_rank, 2, 2, str(out)) == 0
    got = json.loads(out.read_text())
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][:NEW_TOKENS] == want[rid][:NEW_TOKENS], rid
    assert len({tuple(v) for v in want.values()}) == len(want), "tokens must depend on the prompt"


def test_shards_split_heads_and_mlp_and_sum_to_the_full_projection():
    weights = random_weights(CONFIG, 3, np.float32)
    parts = [shard(CONFIG, weights, r, 2) for r in range(2)]
    config, part = parts[1]
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.head_dim) \
        == (4, 2, 96, 32)
    name = "model.layers.0.self_attn.o_proj.weight"
    x = np.random.default_rng(0).standard_normal((3, CONFIG.q_size)).astype(np.float32)
    halves = [x[:, r * config.q_size:(r + 1) * config.q_size] @ parts[r][1][name].T for r in range(2)]
    np.testing.assert_allclose(halves[0] + halves[1], x @ weights[name].T, rtol=1e-5, atol=1e-5)
    assert part["model.embed_tokens.weight"] is weights["model.embed_tokens.weight"]  # replicated
    with pytest.raises(ValueError, match="num_attention_heads = 8 does not divide by tp = 3"):
        shard(CONFIG, weights, 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads = 4 does not divide by tp = 8"):
        shard(CONFIG, weights, 0, 8)


def test_ranks_from_torchrun_or_open_mpi_variables():
    torchrun = ranks_from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                                       "MASTER_PORT": "29400"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.address, torchrun.port) == \
        (3, 4, 1, "10.0.0.2", 29401)
    mpi = ranks_from_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (mpi.rank, mpi.world_size, mpi.local_rank) == (1, 2, 1)
    assert ranks_from_environment({}).world_size == 1


def test_bench_tp_runs_each_tp_and_writes_its_schema(tmp_path):
    """benchmarks/bench_tp.py on the CPU backend, a tiny shape: one case per tp, ratios to tp = 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tp", ROOT / "benchmarks" / "bench_tp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tp.json"
    assert bench.main(["--cpu", "--tp", "1", "2", "--shape", "2,128,4,2,256,512", "--requests", "4",
                       "--max-new-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["cases"]] == ["tp 1", "tp 2"]
    assert all(c["metric"] == "tok/s" and c["value"] > 0 for c in report["cases"])
    assert report["cases"][1]["target"] == 1.8 and report["cases"][1]["detail"]["generated_tokens"] == 16


@pytest.mark.gpu
def test_one_rank_through_nccl_on_the_gpu_generates_the_tokens_of_a_host_reduce():
    """The NCCL group on the GPU at one rank: the model's all-reduces (after the attention output
    and the MLP, on the step's stream) through a one-rank communicator give the tokens of the same
    unfused layers reducing through the host group's identity, for every request.  (The engine
    itself runs a one-rank group as no group, so the reduce is set on the model here.)"""
    import cupy
    from cupy.cuda import nccl

    from llama.parallel import NcclGroup, Ranks
    from _util import BF16

    if not nccl.available:
        pytest.skip("CuPy was built without NCCL here")
    ranks = Ranks(0, 1, 0, "127.0.0.1", 29641)
    config, weights = shard(CONFIG, random_weights(CONFIG, 3, np.float32), 0, 1)
    outputs, reduced = {}, []
    for name, group in (("host", SocketGroup(ranks)), ("nccl", NcclGroup(ranks))):
        model = LlamaModel(config, weights, cupy, BF16)

        def all_reduce(array, group=group, name=name):
            reduced.append(name)
            return group.all_reduce(array)

        model.all_reduce = all_reduce
        outputs[name] = Engine(model, **engine_kwargs()).run(requests())
        group.close()
    assert reduced.count("nccl") >= 2 * CONFIG.num_hidden_layers and reduced.count("host") == reduced.count("nccl")
    assert outputs["nccl"].keys() == outputs["host"].keys() == {r.request_id for r in requests()}
    for rid, tokens in outputs["host"].items():
        assert outputs["nccl"][rid] == tokens and tokens, rid
