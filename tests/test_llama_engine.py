"""The Llama engine of examples/llama end to end on the CPU reference backend (a tiny model,
float64 where tokens must match exactly), plus GPU tests of the same code on CuPy.

* continuous batching (chunked prefill, prefix-cache hits, preemption, mixed steps) gives each
  request the tokens it gets alone, greedy and seeded sampling alike;
* every logits row the engine samples equals an independent dense NumPy forward of the same
  weights over that request's tokens (written here, no cupy_paged), and Hugging Face's
  ``LlamaForCausalLM`` agrees where transformers is installed;
* checkpoints round-trip (sharded or not, bfloat16 or float32);
* sampling: top-k 1 is greedy, a seed reproduces, top-p keeps the smallest set reaching p;
* the CLI's default CPU run finishes and prints its table.
"""
from __future__ import annotations

import doctest
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from llama import (Engine, GenerationRequest, LlamaConfig, LlamaModel, SamplingParams,  # noqa: E402
                   load_checkpoint, random_weights, save_checkpoint)
from llama.sampling import filtered_probs, sample  # noqa: E402
from llama.weights import BF16, INDEX_NAME, read_raw  # noqa: E402
from llama_dense import dense_logits  # noqa: E402
from _util import sanitizer_tool  # noqa: E402


@pytest.fixture(autouse=True)
def _products_zeroed_under_initcheck(monkeypatch):
    """Under initcheck the engine's products start zeroed (``Gemm.zero_outputs``): the tool does
    not see cuBLAS's bf16 writes."""
    if sanitizer_tool() == "initcheck":
        from llama.cublas import Gemm

        monkeypatch.setattr(Gemm, "zero_outputs", True)

TINY = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=50000.0,
                   rms_norm_eps=1e-6, max_position_embeddings=256)


MODEL_SEED = 3  # tiny_model's weights (and _gpu_engines')


def tiny_model(dtype=np.float64, config=TINY, seed=MODEL_SEED, xp=np):
    return LlamaModel(config, random_weights(config, seed), xp, dtype)


# --------------------------------------------------------------------------- helpers


def request_mix(seed=7, count=7, vocab=TINY.vocab_size, new_tokens=10, sampled=False):
    """Prompts of 5..70 tokens, four of them behind one shared 24-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 24).tolist()
    kinds = [SamplingParams(temperature=0.9, top_p=0.85), SamplingParams(temperature=1.2, top_k=7),
             SamplingParams(temperature=0.7)]
    out = []
    for i in range(count):
        prompt = (shared if i % 2 == 0 else []) + rng.integers(0, vocab, int(rng.integers(5, 47))).tolist()
        params = SamplingParams(kinds[i % 3].temperature, kinds[i % 3].top_p, kinds[i % 3].top_k, seed=100 + i) \
            if sampled else SamplingParams()
        out.append(GenerationRequest(f"r{i}", prompt, new_tokens, params))
    return out


def record_plans(engine):
    """Wrap the engine model's forward: returns a list that collects (seq_ids, query_lens) per step."""
    seen, forward = [], engine.model.forward

    def recording(plan, cache, timer=None, all_rows=False):
        seen.append((list(plan.seq_ids), np.asarray(plan.query_lens).tolist()))
        return forward(plan, cache, timer, all_rows)

    engine.model.forward = recording
    return seen


BATCHED = dict(block_size=8, num_blocks=22, max_batch_tokens=24, max_num_seqs=4, max_prefill_chunk=16)


# --------------------------------------------------------------------------- (a) batching


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_continuous_batching_gives_each_request_its_tokens_alone(sampled):
    model = tiny_model()
    requests = request_mix(sampled=sampled)
    engine = Engine(model, **BATCHED)
    plans = record_plans(engine)
    batched = engine.run(requests)
    del model.forward  # the recording wrapper
    stats = engine.stats
    # The run exercised what it claims to: preemption, prefix hits, mixed steps, chunked prompts.
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.steps["mixed"] > 0
    chunks = {}
    for ids, lens in plans:
        for rid, n in zip(ids, lens):
            chunks[rid] = chunks.get(rid, 0) + (n > 1)
    assert max(chunks.values()) >= 3, "some prompt must be prefilled over several steps"
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    for request in requests:
        alone = Engine(model, block_size=16, num_blocks=64, max_batch_tokens=256, max_num_seqs=1)
        assert alone.run([request])[request.request_id] == batched[request.request_id], request.request_id
    outputs = [tuple(t) for t in batched.values()]
    assert len(set(outputs)) == len(outputs) and sum(len(set(t)) > 2 for t in outputs) >= len(outputs) - 1, \
        "tokens must depend on the prompt, else this test could not fail"


def with_stops(requests, outputs, at=3):
    """The requests again, odd ones stopping at the token they generated ``at`` steps in
    (an end-of-sequence id that the host learns only from a step's tokens)."""
    return [GenerationRequest(r.request_id, r.prompt, r.max_new_tokens, r.sampling,
                              outputs[r.request_id][at] if i % 2 else None) for i, r in enumerate(requests)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
@pytest.mark.parametrize("config", [BATCHED, dict(block_size=8, num_blocks=80, max_batch_tokens=64, max_num_seqs=8)],
                         ids=["preempting", "roomy"])
def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(sampled, config):
    """Steps scheduled ahead of the previous step's tokens (inputs moved from the previous step's
    samples, stops learnt one step late) give every request the tokens of synchronous steps."""
    model = tiny_model()
    requests = request_mix(sampled=sampled, new_tokens=14)
    plain = Engine(model, async_scheduling=False, **config).run(requests)
    requests = with_stops(requests, plain)
    engine = Engine(model, async_scheduling=True, **config)
    ahead, schedule_ahead = [], engine.scheduler.schedule_ahead

    def counting():
        plan = schedule_ahead()
        ahead.append(plan is not None)
        return plan

    engine.scheduler.schedule_ahead = counting
    got = engine.run(requests)
    want = Engine(model, async_scheduling=False, **config).run(requests)
    assert sum(ahead) >= 5, "the run must schedule steps ahead, else this test could not fail"
    assert got == want
    assert any(len(want[r.request_id]) < r.max_new_tokens for r in requests), "some request must stop early"
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.stats.generated_tokens == sum(map(len, want.values()))


@pytest.mark.parametrize("where", ["plan of the step ahead", "forward of the step ahead"])
def test_async_engine_recovers_from_a_failed_step_ahead(where, monkeypatch):
    """A step scheduled ahead that fails (its plan build, or its forward pass after the first
    layer wrote K/V) raises, leaves the step in flight pending, and the run goes on to the tokens
    of a run without the fault."""
    import cupy_paged.runtime.scheduler as runtime_scheduler

    model = tiny_model()
    config = dict(block_size=8, num_blocks=80, max_batch_tokens=64, max_num_seqs=8)
    requests = request_mix(new_tokens=14)
    want = Engine(model, async_scheduling=False, **config).run(requests)
    engine = Engine(model, async_scheduling=True, **config)
    for r in requests:
        engine.add_request(r)
    calls, failures, build, block = [0], [], runtime_scheduler.build_plan, model._attention_block

    def failing_build(*args, **kwargs):
        if engine.scheduler._ahead is not None:  # inside schedule_ahead, its batch made
            calls[0] += 1
            if calls[0] in (3, 9):
                raise RuntimeError("injected plan failure")
        return build(*args, **kwargs)

    def failing_block(index, *args):
        if index == 1 and engine.scheduler._ahead is not None:  # layer 0 of the step ahead wrote K/V
            calls[0] += 1
            if calls[0] in (3, 9):
                raise RuntimeError("injected forward failure")
        return block(index, *args)

    if where.startswith("plan"):
        monkeypatch.setattr(runtime_scheduler, "build_plan", failing_build)
    else:
        monkeypatch.setattr(model, "_attention_block", failing_block)
    outputs = {}
    while engine.has_unfinished():
        try:
            finished = engine.step()
        except RuntimeError as error:
            assert "injected" in str(error)
            failures.append(str(error))
            continue
        for r in finished:
            outputs[r.request_id] = r.output_token_ids
    assert len(failures) == 2
    assert outputs == want
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


# --------------------------------------------------------------------------- (b) logits


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_prefill_step_logits_equal_a_dense_forward(layout):
    """One prefill step of three prompts (varlen path), the weights held either way: each
    last-token row equals the dense forward."""
    weights = random_weights(TINY, 5)
    model = LlamaModel(TINY, weights, np, np.float64, weight_layout=layout)
    shape = (TINY.hidden_size, TINY.q_size + 2 * TINY.kv_size)
    assert model.layers[0].qkv.shape == (shape if layout == "in_out" else shape[::-1])
    engine = Engine(model, block_size=8, num_blocks=32, max_batch_tokens=128, ragged=False)
    prompts = [[5, 17, 3], list(range(1, 40)), [int(t) for t in np.random.default_rng(2).integers(0, 96, 21)]]
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(i, prompt, 1))
    plan = engine.scheduler.schedule()
    assert plan.path == "varlen" and plan.num_tokens == sum(map(len, prompts))
    logits = model.forward(plan, engine.cache)
    for row, prompt in zip(logits, prompts):
        expected = dense_logits(TINY, weights, prompt)[-1]
        np.testing.assert_allclose(row, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())


def test_a_weight_layout_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="weight_layout"):
        LlamaModel(TINY, random_weights(TINY, 5), np, np.float64, weight_layout="transposed")


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-9), (np.float32, 2e-4)])
def test_every_sampled_row_equals_a_dense_forward(dtype, rtol):
    """Through a whole batched run (decodes, chunks after prefix hits, recomputation after
    preemption): each sampled row against the dense forward over the tokens up to its position."""
    weights = random_weights(TINY, 11)
    model = LlamaModel(TINY, weights, np, dtype)
    engine = Engine(model, **BATCHED)
    checked, forward = [], model.forward

    def checking(plan, cache, timer=None, all_rows=False):
        logits = forward(plan, cache, timer, all_rows)
        sampling = [i for i, s in zip(plan.seq_ids, plan.sample_mask) if s]
        for rid, index, row in zip(sampling, plan.logits_indices, logits):
            tokens = engine._live[rid][0].token_ids[:int(plan.positions[index]) + 1]
            checked.append((row, dense_logits(TINY, weights, tokens)[-1]))
        return logits

    model.forward = checking
    engine.run(request_mix())
    assert engine.stats.preemptions > 0 and len(checked) >= 40
    for row, expected in checked:
        np.testing.assert_allclose(row, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def test_logits_match_hugging_face(tmp_path):
    """The checkpoint writer's folder read by transformers' LlamaForCausalLM gives the same
    logits (untied and tied heads, Llama 3 rope scaling on)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    for tied in (False, True):
        config = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": tied, "rope_scaling": scaling})
        weights = random_weights(config, 9)
        save_checkpoint(tmp_path / str(tied), config, weights, dtype=np.float32)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / str(tied), dtype=torch.float64).eval()
        model = LlamaModel(*load_checkpoint(tmp_path / str(tied)), np, np.float64)
        engine = Engine(model, block_size=8, num_blocks=16)
        prompt = np.random.default_rng(4).integers(0, config.vocab_size, 50).tolist()
        engine.add_request(GenerationRequest(0, prompt, 1))
        ours = model.forward(engine.scheduler.schedule(), engine.cache)[0]
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        # transformers computes the rotary angles in float32 whatever the model dtype: ~1e-6 apart.
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_rope_scaling_llama3_slows_only_long_wavelengths():
    from llama.model import inverse_frequencies

    plain = inverse_frequencies(TINY)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    scaled = inverse_frequencies(LlamaConfig(**{**TINY.__dict__, "rope_scaling": scaling}))
    wavelength = 2 * np.pi / plain
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_array_equal(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


@pytest.mark.parametrize("path", ["decode", "ragged"])
def test_padded_decode_plan_rows_equal_the_scheduled_step(path):
    """The CUDA graph path's padded decode plan (padding rows on a sequence of its own), run
    eagerly on the CPU: its first rows are the scheduler's plan's logits; the run then goes on."""
    from llama.cuda_graphs import DecodePadding

    model = tiny_model()
    engine = Engine(model, block_size=8, num_blocks=40)
    for r in request_mix(count=3):
        engine.add_request(GenerationRequest(r.request_id, r.prompt, 4))
    engine.step()  # every prompt; the next step decodes all three
    padding = DecodePadding(engine.cache, [2, 8], TINY.num_attention_heads if path == "ragged" else None)
    plan = engine.scheduler.schedule()
    live = [engine._live[i][0] for i in plan.seq_ids]
    want = model.forward(plan, engine.cache)
    padded = padding.plan(plan.seq_ids, [r.token_ids[-1] for r in live])
    assert padded.batch_size == 8 and padded.path == path
    np.testing.assert_allclose(model.forward(padded, engine.cache, all_rows=True)[:3], want, rtol=1e-12, atol=1e-12)
    engine.scheduler.update(plan, want.argmax(-1))
    padding.release()
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


# --------------------------------------------------------------------------- (c) checkpoints


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("shard", [None, 40_000], ids=["one-file", "sharded"])
def test_checkpoint_round_trip(tmp_path, dtype, shard):
    config = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": shard is None})
    weights = random_weights(config, 1)
    save_checkpoint(tmp_path, config, weights, dtype=dtype, max_shard_bytes=shard)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shard is None:
        assert files == ["model.safetensors"] and not (tmp_path / INDEX_NAME).exists()
    else:
        index = json.loads((tmp_path / INDEX_NAME).read_text())
        assert len(files) >= 3 and sorted(set(index["weight_map"].values())) == files
        assert set(index["weight_map"]) == set(weights)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config and list(loaded) == list(weights)
    for name, array in weights.items():
        assert loaded[name].dtype == dtype, name
        np.testing.assert_array_equal(loaded[name].view(np.uint8), array.astype(dtype).view(np.uint8), name)
    for file in files:  # the no-package reader sees the same bytes
        raw = read_raw(tmp_path / file)
        for name, array in raw.items():
            np.testing.assert_array_equal(array.view(np.uint8), loaded[name].view(np.uint8))


def test_checkpoint_loader_drops_extras_and_refuses_missing(tmp_path):
    from safetensors.numpy import save_file

    weights = random_weights(TINY, 2)
    save_checkpoint(tmp_path, TINY, weights)
    extra = dict(weights, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    assert set(load_checkpoint(tmp_path, dtype=np.float64)[1]) == set(weights)
    del extra["model.norm.weight"]
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_checkpoint(tmp_path)


# --------------------------------------------------------------------------- (e) sampling


@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "Llama models"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096), "Llama models"),
    (dict(sliding_window=64), "sliding_window"),
    (dict(num_attention_heads=None), "lacks num_attention_heads"),
    (dict(head_dim=16), "head_dim must be one of"),
])
def test_a_config_this_engine_would_compute_wrongly_is_refused(change, message):
    """Another model (Qwen2's biases, Mistral's window: their tensors or keys dropped, another model
    computed), a config without a Llama's keys (GPT-2), or a head dim the attention does not serve:
    a ValueError naming it at load, not wrong tokens or a traceback from the kernel."""
    values = {**TINY.to_dict(), **change}
    values = {k: v for k, v in values.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_dict(values)


def test_a_draw_that_rounds_to_one_samples_no_filtered_token():
    """A uniform within 2**-25 of 1 rounds to 1.0 in float32 and passed every CDF entry, picking the
    least likely token even where top-k / top-p gave it probability 0."""
    class NearOne:
        def random(self):
            return 1.0 - 2.0 ** -40

    logits = np.array([[5.0, 4.0, 3.0, -20.0]] * 3, np.float32)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0)]
    assert sample(logits, params, [NearOne()] * 3) == [1, 0, 3]


def test_bfloat16_on_the_cpu_backend_serves():
    """--dtype bfloat16 without a GPU: NumPy's matmul of bfloat16 gives float32, and v reached the
    attention in float32 beside bfloat16 q, k and caches (a TypeError); now every request gets its
    tokens, and the greedy ones mostly agree with float32's (bfloat16 noise, random weights)."""
    weights = random_weights(TINY, 3)
    runs = {}
    for dtype in (BF16, np.float32):
        engine = Engine(LlamaModel(TINY, weights, np, dtype), **BATCHED)
        runs[dtype] = engine.run(request_mix())
    assert runs[BF16].keys() == runs[np.float32].keys() and len(runs[BF16]) > 0
    assert all(len(runs[BF16][r]) == len(runs[np.float32][r]) > 0 for r in runs[BF16])
    firsts = [runs[BF16][r][0] == runs[np.float32][r][0] for r in runs[BF16]]
    assert sum(firsts) >= len(firsts) // 2


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 300)).astype(np.float32) * 3
    greedy = sample(logits, [SamplingParams()] * 64, [None] * 64)
    params = [SamplingParams(temperature=t, top_k=1, top_p=p) for t, p in zip(np.linspace(0.1, 3, 64),
                                                                           np.linspace(0.05, 1, 64))]
    assert sample(logits, params, [np.random.default_rng(i) for i in range(64)]) == greedy
    assert greedy == logits.argmax(-1).tolist()


def test_a_seed_reproduces_and_another_differs():
    logits = np.random.default_rng(1).standard_normal((32, 200)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * 32

    def draw(seeds):
        generators = [np.random.default_rng(s) for s in seeds]
        return [sample(logits, params, generators) for _ in range(3)]

    assert draw(range(32)) == draw(range(32))
    assert draw(range(32)) != draw(range(1, 33))


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    probs = np.array([0.05, 0.4, 0.1, 0.25, 0.2])  # by rank: 1 (0.4), 3 (0.25), 4 (0.2), 2, 0
    logits = np.log(probs)[None, :]
    for top_p, kept in [(0.3, [1]), (0.4, [1]), (0.6, [1, 3]), (0.7, [1, 3, 4]), (0.9, [1, 3, 4, 2]),
                        (1.0, [1, 3, 4, 2, 0])]:
        order, filtered = filtered_probs(logits, [1.0], [0], [top_p])
        support = order[0][filtered[0] > 0].tolist()
        assert support == kept, top_p
        np.testing.assert_allclose(filtered[0][:len(kept)], probs[kept] / probs[kept].sum())
    # Sampling follows the filtered distribution: frequencies of 4000 draws within 3 sigma.
    rng = np.random.default_rng(5)
    draws = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [rng])[0] for _ in range(4000)]
    counts = np.bincount(draws, minlength=5)
    assert counts[[0, 2]].sum() == 0
    want = probs[[1, 3, 4]] / probs[[1, 3, 4]].sum()
    assert (np.abs(counts[[1, 3, 4]] / 4000 - want) < 3 * np.sqrt(want * (1 - want) / 4000)).all()


def test_top_k_and_temperature():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]]))
    order, filtered = filtered_probs(logits, [1.0], [2], [1.0])
    assert order[0][:2].tolist() == [3, 2]
    np.testing.assert_allclose(filtered[0], [4 / 7, 3 / 7, 0, 0])
    _, hot = filtered_probs(logits, [2.0], [0], [1.0])
    expected = np.sqrt([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(hot[0], expected / expected.sum())


def test_llama_docstring_examples():
    for name in ("config", "weights", "model", "sampling", "timing", "cuda_graphs", "engine", "cublas", "parallel"):
        module = importlib.import_module(f"llama.{name}")
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, name


# --------------------------------------------------------------------------- (d) the CLI


def test_cli_default_cpu_run():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_llama.py")], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "CPU (reference backend)" in out and re.search(r"^requests\s+32$", out, re.MULTILINE), out
    rate = re.search(r"^tokens per second\s+([\d.]+) generated", out, re.MULTILINE)
    assert rate and float(rate.group(1)) > 0, out
    for label in ("steps", "prefix-cache hit rate", "peak cache use", "preemptions", "time"):
        assert re.search(rf"^{label}\s", out, re.MULTILINE), label


@pytest.mark.parametrize("argv, message", [
    (["--min-prompt", "50", "--max-prompt", "10"], "--min-prompt"), (["--seed", "-1"], "--seed"),
    (["--tp", "0"], "--tp"), (["--checkpoint", "/no/such/folder"], "--checkpoint"),
    (["--cpu", "--cuda-graphs"], "--cuda-graphs"), (["--requests", "0"], "--requests")])
def test_cli_refuses_values_it_cannot_use(argv, message, capsys):
    """A value the run cannot use is an argparse error naming the option, before any work (not
    NumPy's "low >= high", a silent one-rank run or a traceback from deep in the engine)."""
    serve = importlib.import_module("serve_llama")
    with pytest.raises(SystemExit):
        serve.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--tune-products"], ("--tune-products", "--cuda-graphs")),
    (["--block-size", "12"], ("--block-size", "8, 16, 32, 64, 128, 256", "got 12")),
    (["--block-size", "512"], ("--block-size", "8, 16, 32, 64, 128, 256", "got 512")),
    (["--shape", "2,100,4,2,256"], ("--shape", "= 25", "32, 64, 96, 128, 256")),
    (["--shape", "2,2048,4,2,256"], ("--shape", "= 512", "32, 64, 96, 128, 256")),
    (["--shape", "2,128,4,3,256"], ("--shape", "KV_HEADS (3)")),
    (["--shape", "2,x,4,2,256"], ("--shape", "LAYERS,HIDDEN,HEADS,KV_HEADS,INTERMEDIATE")),
    (["--shape", "2,128,4,2"], ("--shape", "LAYERS,HIDDEN,HEADS,KV_HEADS,INTERMEDIATE")),
    (["--shape", "2,128,0,2,256"], ("--shape", "positive integers"))])
def test_cli_refuses_what_the_package_does_not_serve(argv, words, capsys):
    """--tune-products without --cuda-graphs (which it tunes), a block size the kernels do not take
    and a --shape whose head dim the attention does not serve are usage errors naming the option
    and what it allows, not a silently ignored flag or a traceback from the cache or the config."""
    serve = importlib.import_module("serve_llama")
    with pytest.raises(SystemExit) as raised:
        serve.parse_args(["--cpu", *argv])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "usage:" in err, err
    assert all(word in err for word in words), err


def test_cli_help_states_the_limits_and_takes_values_within_them(capsys):
    serve = importlib.import_module("serve_llama")
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a power of two from 8 to 256" in text and "32, 64, 96, 128, 256" in text, text
    assert "needs --cuda-graphs" in text, text
    args = serve.parse_args(["--cpu", "--block-size", "256", "--shape", "2,384,4,2,256,300"])
    config = serve.shaped(serve.CPU_DEFAULT, args.shape)
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (96, 2, 300)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_fused_kernels_compile_without_spills(dtype):
    """fused.cu builds through NVRTC alone (no GPU) for sm_90 and sm_80, with no spills."""
    from cupy.cuda import nvrtc
    from cupy_paged._core.nvrtc import cuda_include_dirs, parse_ptxas_log
    from llama import fused

    for arch in ("sm_80", "sm_90"):
        program = nvrtc.createProgram(fused.SOURCE.read_text(), "fused.cu", [], [])
        try:
            nvrtc.compileProgram(program, [*fused.options(dtype), f"-arch={arch}", "-Xptxas=-v",
                                           *(f"-I{d}" for d in cuda_include_dirs())])
            kernels = parse_ptxas_log(nvrtc.getProgramLog(program))
        finally:
            nvrtc.destroyProgram(program)
        assert {k.kernel for k in kernels} == {"add_rms_norm", "rotary_split", "swiglu", "embed_rows", "argmax_rows"}
        assert all(k.spill_stores == k.spill_loads == 0 for k in kernels), kernels


# --------------------------------------------------------------------------- GPU


def _graph_requests() -> list:
    """The CUDA-graph tests' requests, greedy and sampled: 9 + 5 of 12 new tokens; under
    compute-sanitizer (benchmarks/sanitize.sh, where racecheck's host memory grows with the run
    until the machine's runs out) 3 + 2 of 8, the same paths in fewer steps."""
    count, sampled, new_tokens = (3, 2, 8) if sanitizer_tool() else (9, 5, 12)
    return request_mix(count=count, vocab=1000, new_tokens=new_tokens) + [
        GenerationRequest(f"s{r.request_id}", r.prompt, r.max_new_tokens, r.sampling)
        for r in request_mix(seed=8, count=sampled, vocab=1000, new_tokens=new_tokens, sampled=True)]


MIN_REPLAYS = 4 if sanitizer_tool() else 11  # graph replays the graph tests see at least


def _gpu_engines(graph_sizes, graph_attention="decode"):
    import cupy

    model = tiny_model(BF16, GPU_TINY, xp=cupy)
    kwargs = dict(block_size=16, num_blocks=64, max_batch_tokens=64, max_num_seqs=6, max_prefill_chunk=32)
    # Both engines share the model's cuBLAS choices: tuned here for the graphs' sizes before
    # either runs (the graphed engine would tune them at its first capture, after the eager run).
    for size in graph_sizes:
        model.tune_products(size)
    # The reference steps one at a time; the graphed engine schedules ahead (the GPU default).
    return model, Engine(model, async_scheduling=False, **kwargs), Engine(
        model, cuda_graphs=True, graph_sizes=graph_sizes, graph_attention=graph_attention, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_out", [False, True], ids=["b-k-n", "b-n-k"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)], ids=str)
def test_cublas_gemm_matches_numpy_and_can_be_captured(dtype, rows_out):
    """``a @ b`` with b ``[K, N]``, and ``a @ b.T`` with b ``[N, K]`` (``b_rows_out``), eager and
    captured in a CUDA graph, against float64 NumPy."""
    import cupy
    from llama.cublas import Gemm

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in ((37, 96), (96, 200)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    if rows_out:
        b = np.ascontiguousarray(b.T)
    gemm, stream = Gemm(), cupy.cuda.Stream(non_blocking=True)
    with stream:
        da, db = cupy.asarray(a), cupy.asarray(b)
        eager = gemm(da, db, b_rows_out=rows_out)
        stream.begin_capture()
        try:
            captured = gemm(da, db, b_rows_out=rows_out)
        finally:
            graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
    got = eager.get().astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
    np.testing.assert_array_equal(captured.get().view(np.uint8), eager.get().view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_out", [False, True], ids=["b-k-n", "b-n-k"])
@pytest.mark.parametrize("dtype,out_dtype", [(BF16, None), (BF16, np.float32), (np.dtype(np.float16), None),
                                             (np.dtype(np.float32), None)], ids=str)
def test_every_cublaslt_candidate_matches_numpy_and_can_be_captured(dtype, out_dtype, rows_out):
    """Each of cuBLASLt's heuristic kernels for a skinny product (``Gemm.candidates``, what
    ``Gemm.tune`` chooses among), eager and captured, against float64 NumPy; the captured
    product's bits equal the eager one's; after ``tune`` the product still matches."""
    import cupy
    from llama.cublas import Gemm

    m, k, n = 24, 320, 448
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in ((m, k), (k, n)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    if rows_out:
        b = np.ascontiguousarray(b.T)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    gemm, stream = Gemm(), cupy.cuda.Stream(non_blocking=True)
    plans = gemm.candidates(m, n, k, dtype, out_dtype, rows_out)
    assert plans, "cuBLASLt offered no kernel"

    def check():
        with stream:
            da, db = cupy.asarray(a), cupy.asarray(b)
            eager = gemm(da, db, out_dtype, b_rows_out=rows_out)
            stream.begin_capture()
            try:
                captured = gemm(da, db, out_dtype, b_rows_out=rows_out)
            finally:
                graph = stream.end_capture()
            graph.launch(stream=stream)
            stream.synchronize()
        assert eager.dtype == np.dtype(dtype if out_dtype is None else out_dtype)
        got = eager.get().astype(np.float64)
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
        np.testing.assert_array_equal(captured.get().view(np.uint8), eager.get().view(np.uint8))

    for plan in plans:
        gemm.use(m, n, k, dtype, out_dtype, rows_out, plan)
        check()
    report = gemm.tune(m, n, k, dtype, out_dtype, rows_out)
    assert report["chosen"] == "gemmex" or report["chosen"].startswith("lt")
    check()


GPU_TINY = LlamaConfig(**{**TINY.__dict__, "hidden_size": 256, "head_dim": 64, "vocab_size": 1000,
                            "intermediate_size": 512})


def batched_and_alone(model, new_tokens: int):
    """Greedy requests under continuous batching (BATCHED: chunked prefill, prefix hits, preemption,
    mixed steps, checked to have happened) and each request run alone: (prompts, batched, alone)."""
    requests = [GenerationRequest(r.request_id, r.prompt, new_tokens, r.sampling)
                for r in request_mix(vocab=model.config.vocab_size)]
    engine = Engine(model, async_scheduling=False, **BATCHED)
    batched = engine.run(requests)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.steps["mixed"] > 0, stats
    alone = {r.request_id: Engine(model, block_size=16, num_blocks=64, max_batch_tokens=256, max_num_seqs=1,
                                  async_scheduling=False).run([r])[r.request_id] for r in requests}
    return {r.request_id: r.prompt for r in requests}, batched, alone


# A top-two logit gap under a tenth of the row's standard deviation: a choice that bf16 rounding
# (about 0.4% of a value, some 1% of the row's spread after a few roundings) can tip.
NEAR_TIE = 0.1


def greedy_choices(config, weights, prompt, tokens):
    """Along a greedy run's own tokens, the float64 dense forward's (argmax, top-two gap over the
    row's standard deviation) at each generated position."""
    logits = dense_logits(config, weights, list(prompt) + list(tokens[:-1]))[len(prompt) - 1:]
    top = np.sort(logits, axis=1)[:, -2:]
    return logits.argmax(axis=1), (top[:, 1] - top[:, 0]) / logits.std(axis=1)


@pytest.mark.gpu
def test_gpu_continuous_batching_gives_each_request_its_first_16_tokens_alone():
    """bf16 on the GPU: each greedy request's first 16 tokens under continuous batching equal the
    tokens it gets run alone (other kernel paths, step shapes and product sizes), up to a near tie
    of the float64 forward, where bf16 rounding may choose either; and every token of both runs
    that is not a near tie is the float64 forward's choice along that run's tokens."""
    import cupy

    import cupy_paged

    weights = random_weights(GPU_TINY, MODEL_SEED)
    prompts, batched, alone = batched_and_alone(LlamaModel(GPU_TINY, weights, cupy, BF16), 16)
    cupy_paged.check_errors()
    rounded = {name: np.asarray(w).astype(BF16) for name, w in weights.items()}  # what the GPU model holds
    clear = 0
    for rid in alone:
        gaps = {}
        for name, tokens in (("alone", alone[rid][:16]), ("batched", batched[rid][:16])):
            best, gaps[name] = greedy_choices(GPU_TINY, rounded, prompts[rid], tokens)
            wrong = [i for i in range(16) if tokens[i] != best[i] and gaps[name][i] >= NEAR_TIE]
            assert not wrong, f"{rid} {name}: tokens {wrong} are not the float64 forward's clear choice"
            clear += int((gaps[name] >= NEAR_TIE).sum())
        first = next((i for i in range(16) if batched[rid][i] != alone[rid][i]), 16)
        assert first == 16 or gaps["alone"][first] < NEAR_TIE, \
            f"{rid}: batched and alone differ at token {first}, where the choice is clear ({gaps['alone'][first]:.2f})"
    assert clear >= 16 * len(alone), "most choices must be clear, else this test could not fail"


@pytest.mark.gpu
@pytest.mark.parametrize("graph_attention", ["decode", "ragged"])
def test_cuda_graph_decode_tokens_equal_eager(graph_attention):
    """Graphs captured at every batch size (no padding: the same shapes as eager, so the same
    cuBLAS and attention launches) replay to exactly the eager tokens, greedy and sampled."""
    import cupy_paged

    _, eager, graphed = _gpu_engines(list(range(1, 7)), graph_attention)
    requests = _graph_requests()
    want = eager.run(requests)
    got = graphed.run(requests)
    cupy_paged.check_errors()
    assert graphed.stats.graph_replays >= MIN_REPLAYS and graphed.stats.steps["decode"] == eager.stats.steps["decode"]
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("graph_attention", ["decode", "ragged"])
def test_async_cuda_graphs_with_stops_equal_synchronous_eager(graph_attention):
    """Decode graphs scheduled ahead while requests stop on end-of-sequence ids the host learns a
    step late (their rows in the step ahead dropped): every request's tokens equal synchronous
    eager steps', greedy and sampled, and no block is left held."""
    import cupy_paged

    model, eager, _ = _gpu_engines([8])
    requests = with_stops(_graph_requests(), eager.run(_graph_requests()))
    kwargs = dict(block_size=16, num_blocks=64, max_batch_tokens=64, max_num_seqs=6, max_prefill_chunk=32)
    want = Engine(model, async_scheduling=False, **kwargs).run(requests)
    graphed = Engine(model, cuda_graphs=True, graph_sizes=[2, 4, 6], graph_attention=graph_attention, **kwargs)
    got = graphed.run(requests)
    cupy_paged.check_errors()
    assert graphed.async_scheduling and graphed.stats.graph_replays >= MIN_REPLAYS
    assert any(len(want[r.request_id]) < r.max_new_tokens for r in requests), "some request must stop early"
    assert got == want
    assert graphed.cache.num_free_blocks == graphed.cache.num_blocks - 1  # the graphs' padding block


@pytest.mark.gpu
def test_padded_cuda_graph_logits_match_eager_and_the_dense_forward():
    """A decode batch padded to a larger captured size: its logits match the eager step's and
    the dense float64 forward within bfloat16 tolerance, and the padding records no device error."""
    import cupy_paged

    model, eager, graphed = _gpu_engines(graph_sizes=[8])
    requests = request_mix(count=3, vocab=1000, new_tokens=2)
    eager.run(requests)
    graphed.run(requests)
    cupy_paged.check_errors()
    assert graphed.stats.graph_replays == 1
    engine = Engine(model, block_size=16, num_blocks=64, cuda_graphs=True, graph_sizes=[8], async_scheduling=False)
    for r in requests:
        engine.add_request(GenerationRequest(r.request_id, r.prompt, 3))
    engine.step()  # the prompts; the next step decodes all three
    plan = engine.scheduler.schedule()  # built by the graphs: padded to 8 rows
    assert plan.graph_rows == 3 and plan.batch_size == 8 and plan.path == "decode"
    live = [engine._live[i][0] for i in plan.seq_ids[:3]]
    with engine.stream:
        eager_logits = model.forward(plan, engine.cache)[:3].get()
        graph_logits, graph_tokens = engine.graphs.replay(plan)
        graph_logits, graph_tokens = graph_logits.get(), graph_tokens.get()
        assert (graph_tokens == graph_logits.argmax(-1)).all()
    cupy_paged.check_errors()
    weights = {k: np.asarray(v) for k, v in random_weights(model.config, MODEL_SEED, BF16).items()}
    for row, graph_row, request in zip(eager_logits, graph_logits, live):
        dense = dense_logits(model.config, weights, request.token_ids)[-1]
        for got in (row, graph_row):
            assert np.linalg.norm(got - dense) <= 5e-2 * np.linalg.norm(dense)
        assert np.linalg.norm(graph_row - row) <= 1e-2 * np.linalg.norm(row)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_fused_kernels_equal_the_array_expressions(dtype):
    """Each fused kernel against the model's CuPy expressions it replaces (the unfused path):
    the same values to within one rounding of the weights' dtype; argmax exact, ties to the
    first index, NaN first."""
    import cupy
    from llama.fused import argmax_rows

    config = LlamaConfig(**{**TINY.__dict__, "hidden_size": 320, "head_dim": 64, "num_attention_heads": 5,
                            "num_key_value_heads": 1, "vocab_size": 3001, "intermediate_size": 600})
    model = tiny_model(dtype, config, xp=cupy)
    f, layer, rng = model.fused, model.layers[0], cupy.random.default_rng(5)
    tokens = 37

    def close(got, want, tol):
        got, want = cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(want).astype(np.float64)
        assert got.shape == want.shape and np.isfinite(got).all()
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())

    eps = float(ml_dtypes.finfo(dtype).eps)
    x = rng.standard_normal((tokens, config.hidden_size), dtype=cupy.float32)
    delta = rng.standard_normal((tokens, config.hidden_size), dtype=cupy.float32).astype(dtype)
    summed, normed = f.add_rms_norm(x, delta, layer.input_norm)
    close(summed, x + delta.astype(cupy.float32), 1e-6)
    close(normed, model.rms_norm(x + delta.astype(cupy.float32), layer.input_norm), 2 * eps)
    alone, normed = f.add_rms_norm(x, None, layer.input_norm)
    close(alone, x, 0.0)
    close(normed, model.rms_norm(x, layer.input_norm), 2 * eps)
    in_place = x.copy()
    f.add_rms_norm(in_place, delta, layer.input_norm, out=in_place)
    close(in_place, summed, 0.0)
    # Rows a block holds in registers exactly (2,048 over 256 threads), with a ragged end, and
    # longer than its 1,024 threads hold (the loop that reads the row back).
    for hidden in (2048, 2049, 8200):
        wide_x = rng.standard_normal((5, hidden), dtype=cupy.float32)
        wide_delta = rng.standard_normal((5, hidden), dtype=cupy.float32).astype(dtype)
        weight = 1 + 0.1 * rng.standard_normal(hidden, dtype=cupy.float32)
        summed, normed = f.add_rms_norm(wide_x, wide_delta, weight)
        close(summed, wide_x + wide_delta.astype(cupy.float32), 1e-6)
        close(normed, model.rms_norm(wide_x + wide_delta.astype(cupy.float32), weight), 2 * eps)

    qkv = rng.standard_normal((tokens, config.q_size + 2 * config.kv_size), dtype=cupy.float32).astype(dtype)
    positions = cupy.asarray(np.random.default_rng(1).integers(0, config.max_position_embeddings, tokens), np.int32)
    q, k, v = f.rotary_split(qkv, positions, model.cos, model.sin, config.num_attention_heads,
                             config.num_key_value_heads, config.head_dim)
    cos, sin = model.cos[positions][:, None, :], model.sin[positions][:, None, :]
    split = [config.q_size, config.q_size + config.kv_size]
    want_q, want_k, want_v = cupy.split(qkv, split, axis=1)
    close(q, model.rotate(want_q.reshape(q.shape), cos, sin), 2 * eps)
    close(k, model.rotate(want_k.reshape(k.shape), cos, sin), 2 * eps)
    close(v, want_v.reshape(v.shape), 0.0)
    for head_dim, heads, kv_heads in ((128, 16, 4), (256, 3, 1)):  # 64 and 128 threads a head
        table = rng.standard_normal((50, head_dim // 2), dtype=cupy.float32)
        sin_table = rng.standard_normal((50, head_dim // 2), dtype=cupy.float32)
        wide = rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim), dtype=cupy.float32).astype(dtype)
        at = cupy.asarray(np.random.default_rng(2).integers(0, 50, tokens), np.int32)
        q, k, v = f.rotary_split(wide, at, table, sin_table, heads, kv_heads, head_dim)
        want_q, want_k, want_v = cupy.split(wide, [heads * head_dim, (heads + kv_heads) * head_dim], axis=1)
        cos_at, sin_at = table[at][:, None, :], sin_table[at][:, None, :]
        close(q, model.rotate(want_q.reshape(q.shape), cos_at, sin_at), 2 * eps)
        close(k, model.rotate(want_k.reshape(k.shape), cos_at, sin_at), 2 * eps)
        close(v, want_v.reshape(v.shape), 0.0)

    gate_up = rng.standard_normal((tokens, 2 * config.intermediate_size), dtype=cupy.float32).astype(dtype)
    gate, up = (a.astype(cupy.float32) for a in cupy.split(gate_up, 2, axis=1))
    close(f.swiglu(gate_up), gate / (1 + cupy.exp(-gate)) * up, 2 * eps)

    ids = cupy.asarray([0, 5, config.vocab_size - 1, 5], np.int32)
    close(f.embed(model.embed, ids), model.embed[ids].astype(cupy.float32), 0.0)

    logits = rng.standard_normal((9, config.vocab_size), dtype=cupy.float32)
    logits[1, [17, 900, 2999]] = 50.0  # a tie: the first index wins
    logits[2, [44, 3000]] = cupy.nan  # NaN counts as the largest, first one
    logits[3] = -cupy.inf
    got = argmax_rows(logits).get().tolist()
    assert got == np.argmax(logits.get(), axis=-1).tolist()
    assert got[1:4] == [17, 44, 0]
    # Rows longer than a block's batch of loads (8 x 1,024): the maximum in a later batch, a tie
    # across batches, a NaN in the last one.
    wide = rng.standard_normal((4, 32000), dtype=cupy.float32)
    wide[0, 31999] = 9.0
    wide[1, [5, 20000]] = 9.0
    wide[2, [100, 30001]] = cupy.nan
    got = argmax_rows(wide).get().tolist()
    assert got == np.argmax(wide.get(), axis=-1).tolist() and got[:3] == [31999, 5, 100]


@pytest.mark.gpu
def test_gpu_weight_layouts_give_the_same_logits():
    """The same weights held [in, out] and [out, in] (read transposed by cuBLAS): one prefill
    step's logits within bfloat16 rounding of each other, through the fused forward."""
    import cupy
    import cupy_paged

    model, engine, _ = _gpu_engines(graph_sizes=[8])
    config = model.config
    other = LlamaModel(config, random_weights(config, MODEL_SEED), cupy, BF16, weight_layout="out_in")
    assert other.layers[0].qkv.shape == model.layers[0].qkv.shape[::-1]
    for r in request_mix(count=5, vocab=1000, new_tokens=3):
        engine.add_request(r)
    with engine.stream:
        plan = engine.scheduler.schedule()
        want = model.forward(plan, engine.cache).get()
        got = other.forward(plan, engine.cache).get()  # writes the same K/V again
    assert np.isfinite(got).all() and got.shape == want.shape
    assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)
    cupy_paged.check_errors()


@pytest.mark.gpu
def test_fused_forward_equals_the_array_expressions():
    """The model's fused forward and its unfused one give the same logits within bfloat16
    rounding, over a prefill step (chunks of several prompts) and the decode step after it."""
    import cupy
    import cupy_paged

    model, engine, _ = _gpu_engines(graph_sizes=[8])
    for r in request_mix(count=5, vocab=1000, new_tokens=3):
        engine.add_request(r)
    with engine.stream:
        for step in range(2):
            plan = engine.scheduler.schedule()
            fused = model.fused
            got = model.forward(plan, engine.cache)
            model.fused = None
            try:
                want = model.forward(plan, engine.cache)  # writes the same K/V again
            finally:
                model.fused = fused
            got, want = got.get(), want.get()
            assert np.isfinite(got).all() and got.shape == want.shape
            assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want), step
            tokens = [int(t) for t in cupy.asnumpy(cupy.argmax(cupy.asarray(got), axis=-1))]
            engine.scheduler.update(plan, tokens)
    cupy_paged.check_errors()


@pytest.mark.gpu
def test_decode_rotary_in_the_attention_launch_equals_rotary_split():
    """A decode step (the decode graphs' padded plan, path "decode") with q and the new k rotated
    inside ``flash_attn_with_kvcache`` (the fused path's default) against the same step through
    ``rotary_split`` and ``StepPlan.attention``: layer 0's new keys get the same bits, the logits
    and later layers' keys agree within bfloat16 rounding, and the step launches no
    ``rotary_split``."""
    import cupy
    import cupy_paged

    model, _, _ = _gpu_engines(graph_sizes=[8])
    assert model.rotary_in_attention
    engine = Engine(model, block_size=16, num_blocks=64, cuda_graphs=True, graph_sizes=[8], async_scheduling=False)
    for r in request_mix(count=3, vocab=1000, new_tokens=2):
        engine.add_request(GenerationRequest(r.request_id, r.prompt, 3))
    engine.step()  # the prompts; the next step decodes all three
    plan = engine.scheduler.schedule()  # built by the graphs: padded to 8 rows
    assert plan.path == "decode" and plan.graph_rows == 3
    layers = model.config.num_hidden_layers
    split_calls = []
    rotary_split = model.fused.rotary_split

    def counted(*args):
        split_calls.append(1)
        return rotary_split(*args)

    def new_keys():
        slots = cupy.asarray(plan.slot_mapping)
        return [cupy.asnumpy(engine.cache.layer(i)[0].reshape(-1, model.config.kv_size)[slots]) for i in range(layers)]

    with engine.stream:
        model.fused.rotary_split = counted
        try:
            got = model.forward(plan, engine.cache)[:3].get()
            got_keys = new_keys()
            assert not split_calls
            model.rotary_in_attention = False
            want = model.forward(plan, engine.cache)[:3].get()  # writes the step's K/V again
            want_keys = new_keys()
            assert len(split_calls) == layers
        finally:
            model.rotary_in_attention = True
            model.fused.rotary_split = rotary_split
    cupy_paged.check_errors()
    assert np.isfinite(got).all() and got.shape == want.shape
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    # Layer 0's new keys come from the same product either way: the same bits.  Later layers'
    # inputs went through two attention kernels (with and without the rotation code).
    np.testing.assert_array_equal(got_keys[0].view(np.uint16), want_keys[0].view(np.uint16))
    for layer, (a, b) in enumerate(zip(got_keys, want_keys)):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), layer
