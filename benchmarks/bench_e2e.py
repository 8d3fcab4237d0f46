"""End to end: our Llama engine against Hugging Face transformers' continuous batching, same checkpoint.

One random-weight Hugging Face ``LlamaForCausalLM`` (HF's own initialisation, ``torch.manual_seed``)
is saved as safetensors; our engine loads that folder through ``llama.load_checkpoint`` and HF
loads it through ``from_pretrained`` (``--checkpoint DIR``: an existing HF Llama folder instead).
Every configuration serves the same N requests (per concurrency N: prompt lengths uniform in
[--min-prompt, --max-prompt] and random token ids from ``--seed``), greedy, ``--max-new-tokens``
each with no EOS stop (every request generates exactly that many; checked for every run).

Configurations (``--configs``, keys in brackets):

* ``ours graphs`` [ours-graphs], ``ours no-graphs`` [ours]: ``llama.Engine(max_num_seqs=N,
  cuda_graphs=...)``, cache sized for all N requests at their longest; ``engine.warm_up()``
  (kernels compiled, decode graphs captured) before the timed ``engine.run``.  Both schedule
  asynchronously (the engine's GPU default); ``ours graphs sync`` [ours-graphs-sync] steps one
  at a time (``async_scheduling=False``), to show what the overlap gains, and ``ours graphs
  ragged-launch`` [ours-graphs-ragged] runs the decode graphs' attention on the ragged launch
  instead of the decode kernel (``graph_attention="ragged"``); ``ours graphs rotary-split``
  [ours-graphs-rotary-split] rotates a decode step's q and k in the separate ``rotary_split``
  kernel instead of inside the decode kernel (``LlamaModel.rotary_in_attention = False``);
  ``ours graphs tuned`` [ours-graphs-tuned] captures the decode graphs with the fastest of
  cuBLASLt's candidates timed per batch size for each product (``Engine(tune_products=True)``)
  instead of cuBLAS's default kernels (the other configurations run on those even after it).
* ``hf sdpa graphs`` / ``hf sdpa no-graphs`` [hf-sdpa-graphs, hf-sdpa]: ``generate_batch`` with
  ``attn_implementation="paged|sdpa"``.
* ``hf cupy_paged graphs`` / ``hf cupy_paged no-graphs`` [hf-cupy_paged-graphs, hf-cupy_paged]:
  ``"paged|flash_attention_2"`` running on cupy_paged through ``cupy_paged.integrations.transformers``.
* ``hf eager no-graphs`` [hf-eager]: ``"paged|eager"``, at the first concurrency only: the noise
  level of greedy agreement.

HF's continuous batching gets ``num_blocks`` for all N requests at their longest (25% spare),
``max_batch_tokens`` equal to ours (``--max-batch-tokens``, default 8,192 on the GPU: a
throughput setting for a batch of prompts arriving at once, as vLLM's for offline batches),
``max_requests_per_batch=N``, ``use_cuda_graph`` on or off and
``auto_switch_to_flash=False`` (options that the installed transformers lacks are dropped and
listed in the JSON).  Its warm-up: one untimed ``generate_batch`` with ``--hf-warmup-tokens`` new
tokens each on a persistent manager (HF's ``warmup=True``: its graph pre-capture), then the timed
call on that manager, so its cache is allocated; with graphs the warm-up serves the same prompts,
so that the graphs of the prefill phase are captured too (graphs of shapes first met later are
captured inside the timed run), without graphs it serves two of them.

Each run's figure is generated tokens per wall second of serving all N requests: ``engine.run``
for ours; for HF from the ``generate_batch`` call to the last request's finish as HF records it
(``GenerationOutput.lifespan``; the whole call where it is missing), which leaves out the
manager's teardown after the last token.  The other figures: greedy agreement (per request, the
common prefix of the tokens with HF ``paged|sdpa``'s at the same concurrency: median and fraction
of requests fully equal), our decode steps (wall time of each, from a wrapper around
``Engine.step``) against their floor (every layer's matrices and the LM head read once, plus the
K/V of the running sequences' contexts, at 4.44 TB/s), and the issue's targets for ours with
graphs: at least 40,000 tok/s at 64 requests and 80,000 at 256, over 20x HF ``paged|sdpa`` with
graphs and 5x HF on our kernels with graphs.

Order and budget: the targets' runs first (ours, HF on cupy_paged and HF sdpa, with graphs, at
each ``--concurrency``), then the runs without graphs and HF eager, then the ``--sweep`` points
(only ``--sweep-configs``).  A run is skipped when its predicted time (from the same
configuration's measured runs, else the issue's figures) exceeds ``--max-run-seconds`` or would
end past ``--max-seconds`` from the start.  Progress lines are flushed and the JSON is rewritten
after every run, so a cut-off run keeps what finished.

Writes ``benchmarks/results/e2e.json`` (device, versions, date, and cases ``name, metric,
value, peers``) and ``e2e.png`` (tok/s against concurrency), and prints a markdown table last.

    python benchmarks/bench_e2e.py                          # GPU (H200): about 6 minutes
    python benchmarks/bench_e2e.py --concurrency 64 --sweep ""
    python benchmarks/bench_e2e.py --cpu                    # tiny float32 model on the CPU
    python benchmarks/bench_e2e.py --list                   # the planned runs, predicted seconds
    python benchmarks/bench_e2e.py --report results/e2e.json  # plot and tables of a JSON again

``--cpu`` (automatic without a GPU): a tiny float32 model, a few short prompts, 8 new tokens,
ours on the NumPy reference backend and HF on torch's CPU (sdpa, eager and cupy_paged's CPU
reference); the greedy tokens of ours and HF sdpa must be equal for every request (exit status
1 otherwise).  Its JSON goes to ``--out`` (default ``e2e_cpu.json`` in the temporary folder).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import inspect
import json
import logging
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the CPU model's tiny products: threads only contend

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cupy_paged._core.arrays import gpu_available  # noqa: E402
from _util import common_prefix  # noqa: E402  (tests/_util.py, shared with the HF tests)

sys.path.insert(0, str(HERE))
import bench_calls  # noqa: E402  (device name and versions, as every benchmark reports them)
from bench_host import cpu_name  # noqa: E402
import ceiling  # noqa: E402  (the read ceiling the other floors use: 4.44 TB/s on the H200)

RESULTS = HERE / "results" / "e2e.json"
PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # prompt ids avoid the special tokens


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: who serves (``ours`` or ``hf``), CUDA graphs, HF's attention implementation."""

    key: str
    label: str
    engine: str
    graphs: bool
    attn: str | None = None
    prior_tok_s: float = 1000.0  # the figure at 64 requests (H200), for the first prediction
    sync: bool = False  # ours: one step at a time (async_scheduling=False), for the overlap's gain
    graph_attention: str = "decode"  # ours: the decode graphs' attention (Engine(graph_attention=))
    rotary_in_attention: bool = True  # ours: decode steps rotate inside the decode kernel (False: rotary_split)
    tune_products: bool = False  # ours: the decode graphs' products on the fastest timed cuBLAS kernel


SPECS = {s.key: s for s in (
    Spec("ours-graphs", "ours graphs", "ours", True, prior_tok_s=13500),
    Spec("ours-graphs-sync", "ours graphs sync", "ours", True, prior_tok_s=31300, sync=True),
    Spec("ours-graphs-ragged", "ours graphs ragged-launch", "ours", True, prior_tok_s=46000, graph_attention="ragged"),
    Spec("ours-graphs-rotary-split", "ours graphs rotary-split", "ours", True, prior_tok_s=55000,
         rotary_in_attention=False),
    Spec("ours-graphs-tuned", "ours graphs tuned", "ours", True, prior_tok_s=55000, tune_products=True),
    Spec("ours", "ours no-graphs", "ours", False, prior_tok_s=3000),
    Spec("hf-cupy_paged-graphs", "hf cupy_paged graphs", "hf", True, "paged|flash_attention_2", 8200),
    Spec("hf-sdpa-graphs", "hf sdpa graphs", "hf", True, "paged|sdpa", 1860),
    Spec("hf-cupy_paged", "hf cupy_paged no-graphs", "hf", False, "paged|flash_attention_2", 2600),
    Spec("hf-sdpa", "hf sdpa no-graphs", "hf", False, "paged|sdpa", 830),
    Spec("hf-eager", "hf eager no-graphs", "hf", False, "paged|eager", 600),
)}
TARGET_KEYS = ("ours-graphs", "hf-cupy_paged-graphs", "hf-sdpa-graphs")
REFERENCES = ("hf-sdpa", "hf-sdpa-graphs")  # agreement is measured against the first that ran
# (concurrency, tok/s) and (peer, ratio) targets of ours with graphs, from the issue
RATE_TARGETS = {64: 40000.0, 256: 80000.0}
RATIO_TARGETS = {"hf-sdpa-graphs": 20.0, "hf-cupy_paged-graphs": 5.0}

DEFAULTS = {
    "gpu": dict(concurrency="64,256", sweep="8,16,32,128", min_prompt=128, max_prompt=1024, max_new_tokens=256,
                max_batch_tokens=8192, hf_warmup_tokens=16, max_seconds=330.0, max_run_seconds=60.0,
                configs=",".join(SPECS), sweep_configs="ours-graphs,ours,hf-cupy_paged-graphs,hf-sdpa-graphs"),
    "cpu": dict(concurrency="4", sweep="", min_prompt=8, max_prompt=40, max_new_tokens=8, max_batch_tokens=64,
                hf_warmup_tokens=2, max_seconds=600.0, max_run_seconds=300.0,
                configs="ours,hf-sdpa,hf-eager,hf-cupy_paged", sweep_configs="ours,hf-sdpa"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the CPU mode even where a GPU answers")
    p.add_argument("--checkpoint", type=pathlib.Path, help="an existing Hugging Face Llama folder")
    p.add_argument("--concurrency", help="request counts of the full comparison (default 64,256)")
    p.add_argument("--sweep", help="extra request counts for the plot, --sweep-configs only (default 8,16,32,128)")
    p.add_argument("--configs", help=f"configurations to run: {','.join(SPECS)}")
    p.add_argument("--sweep-configs", help="configurations run at the sweep points")
    p.add_argument("--min-prompt", type=int)
    p.add_argument("--max-prompt", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-batch-tokens", type=int, help="token budget of a step, ours and HF's")
    p.add_argument("--block-size", type=int, default=16, help="our cache's block size")
    p.add_argument("--hf-warmup-tokens", type=int, help="new tokens of HF's untimed warm-up call (0: none)")
    p.add_argument("--max-seconds", type=float, help="skip a run that would end past this many seconds")
    p.add_argument("--max-run-seconds", type=float, help="skip a run predicted to take longer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-layout", choices=("in_out", "out_in"), default="in_out",
                   help="our model's weights [in, out], or [out, in] as the checkpoint stores them")
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--list", action="store_true", help="print the planned runs and their predicted seconds")
    p.add_argument("--report", type=pathlib.Path, metavar="JSON",
                   help="only plot and print the tables of a JSON this wrote (a cut-off run's, say)")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu or not _gpu() else "gpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.concurrency, args.sweep = _counts(args.concurrency), _counts(args.sweep)
    args.configs, args.sweep_configs = _keys(p, args.configs), _keys(p, args.sweep_configs)
    if not args.concurrency:
        p.error("--concurrency needs at least one request count")
    if args.out is None:
        args.out = RESULTS if args.device == "gpu" else pathlib.Path(tempfile.gettempdir()) / "e2e_cpu.json"
        if args.weight_layout != "in_out":  # not over the default layout's figures
            args.out = args.out.with_name(f"{args.out.stem}_{args.weight_layout}.json")
    return args


def _gpu() -> bool:
    if not gpu_available():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _counts(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _keys(parser, text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SPECS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(SPECS)}")
    return keys


# ----------------------------------------------------------------------------------- model and prompts

def shape_of(args):
    """The built-in shape of the mode (``llama.GPU_DEFAULT`` / ``CPU_DEFAULT``)."""
    from llama import CPU_DEFAULT, GPU_DEFAULT

    return GPU_DEFAULT if args.device == "gpu" else CPU_DEFAULT


def build_checkpoint(args, folder: pathlib.Path) -> dict:
    """Save a random-weight HF ``LlamaForCausalLM`` of the mode's shape into ``folder``; return
    the activation scale of one random prompt through it (hidden-state RMS per layer, logits)."""
    import torch
    import transformers

    c = shape_of(args)
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    device = "cuda" if args.device == "gpu" else "cpu"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch_dtype(args)).eval()
    ids = torch.randint(FIRST_TOKEN, c.vocab_size, (1, min(256, args.max_prompt)),
                        generator=torch.Generator().manual_seed(args.seed)).to(device)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    logits = out.logits.float()
    check = dict(initializer_range=getattr(config, "initializer_range", None),
                 hidden_rms=[round(float(h.float().pow(2).mean().sqrt()), 4) for h in out.hidden_states],
                 logits_std=round(float(logits.std()), 4), logits_max_abs=round(float(logits.abs().max()), 4))
    if not math.isfinite(check["logits_max_abs"]) or check["logits_max_abs"] > 100:
        raise RuntimeError(f"HF's initialisation gives out-of-scale logits: {check}")
    model.save_pretrained(folder)
    del model, out
    bench_calls.release()
    return check


def torch_dtype(args):
    import torch

    return torch.bfloat16 if args.device == "gpu" else torch.float32


def load_ours(args, folder):
    """Our ``LlamaModel`` from the checkpoint folder: bf16 on CuPy, float32 on NumPy."""
    from llama import LlamaModel, load_checkpoint
    from llama.weights import BF16

    config, weights = load_checkpoint(folder)
    if args.device == "gpu":
        import cupy

        return LlamaModel(config, weights, cupy, BF16, weight_layout=args.weight_layout)
    return LlamaModel(config, weights, np, np.float32, weight_layout=args.weight_layout)


def make_prompts(args, n: int, vocab: int) -> list[list[int]]:
    """The ``n`` prompts every configuration serves at concurrency ``n``."""
    rng = np.random.default_rng([args.seed, n])
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, n)
    return [rng.integers(FIRST_TOKEN, vocab, int(length)).tolist() for length in lengths]


def warm_up_prompts(prompts: list, vocab: int) -> list:
    """Prompts of the same lengths as ``prompts`` with every token moved to the next id (special ids
    skipped): a warm-up over them meets every shape of the timed run, and neither engine's prefix
    cache then holds a block the timed prompts can hit."""
    span = vocab - FIRST_TOKEN
    return [[FIRST_TOKEN + (t - FIRST_TOKEN + 1) % span for t in p] for p in prompts]


def floor_bytes(config, itemsize: int) -> tuple[int, int]:
    """Bytes a decode step must read: every layer's matrices and the LM head (not the embedding
    table), and the K/V bytes of one cached token over all layers."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    weights = (config.num_hidden_layers * layer + h * config.vocab_size) * itemsize
    return weights, config.num_hidden_layers * 2 * kv * itemsize


# ----------------------------------------------------------------------------------- runs

@dataclasses.dataclass
class Run:
    """One timed serving of N requests: wall seconds, warm-up seconds, each request's tokens."""

    spec: Spec
    n: int
    wall_s: float
    warm_s: float
    tokens: list
    detail: dict

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tok_s(self) -> float:
        return self.generated / max(self.wall_s, 1e-9)


class StepLog:
    """Wall time and batch of every decode step of an engine (wraps its ``step``: a few
    microseconds of Python a step inside ours' timed run, which HF's has no counterpart of).

    A logged time is that of the ``step()`` call which launched the decode step.  With
    asynchronous scheduling such a call launches one step and then waits for the step launched
    before it (``Engine.in_flight_kind`` names that step's kind before the call), so the call
    that launches the first decode step after a prefill or mixed step also waits for the rest of
    that step's device time.  Each logged step records whether the step it waited for was a
    decode step, or nothing (without asynchronous scheduling a call waits for the step it
    launched itself): those are the steady steps, the others the transitions.

    Nothing per request is read inside the timed run (summing the running requests' cached
    tokens each step cost about 1.5 us a request, inside the wall time): the mean K/V context of a
    decode row comes afterwards from the prompts and the tokens generated, since request ``r``'s
    ``j``-th decode (``j = 1 .. generated - 1``; the first token comes from its prefill) attends
    to ``len(prompt) + j`` tokens, whatever the schedule.
    """

    TRANSITIONS_KEPT = 8  # the transitions' times a summary lists

    def __init__(self, engine):
        self.engine, self._step = engine, engine.step
        self.seconds, self.batches, self.steady = [], [], []
        engine.step = self.step

    def step(self):
        engine = self.engine
        batch = len(engine.scheduler.running)
        decodes = engine.stats.steps["decode"]
        settles = engine.in_flight_kind  # the step this call waits for, launched by the call before
        start = time.perf_counter()
        finished = self._step()
        seconds = time.perf_counter() - start
        if engine.stats.steps["decode"] > decodes:
            self.seconds.append(seconds)
            self.batches.append(batch)
            self.steady.append(settles is None or settles == "decode")
        return finished

    def summary(self, prompts: list, tokens: list, weight_bytes: int | None, kv_bytes: int | None) -> dict:
        """Decode-step wall times, all of them and the steady ones.

        ``count``, ``mean_ms`` and ``median_ms`` cover every logged decode step; ``mean_batch``,
        ``max_batch`` and ``mean_context`` describe them.  With the byte counts,
        ``floor_ms_at_mean`` is the floor at the mean batch and context and ``over_floor`` the
        mean step time over it.

        A ``step()`` call launches one step and waits for the one launched before it, so the first
        decode step after a prefill or mixed step carries the rest of that step's device time
        (several milliseconds against a decode step's one): ``steady_count``, ``steady_mean_ms``
        and ``steady_median_ms`` cover only the decode steps whose call waited for a decode step
        (or for its own step, without asynchronous scheduling), ``steady_over_floor`` is the
        steady mean over the same floor, and ``transition_ms`` lists the wall milliseconds of the
        others (the first :attr:`TRANSITIONS_KEPT`; ``count - steady_count`` of them in all).
        """
        if not self.seconds:
            return {"count": 0}
        count, total = len(self.seconds), sum(self.seconds)
        mean_batch = sum(self.batches) / count
        rows = sum(max(0, len(t) - 1) for t in tokens)
        attended = sum(len(p) * (len(t) - 1) + len(t) * (len(t) - 1) // 2 for p, t in zip(prompts, tokens) if t)
        mean_context = attended / max(1, rows)
        steady = [s for s, kept in zip(self.seconds, self.steady) if kept]
        transitions = [s for s, kept in zip(self.seconds, self.steady) if not kept]
        steady_mean = statistics.fmean(steady) if steady else None
        out = dict(count=count, mean_ms=round(1e3 * total / count, 4),
                   median_ms=round(1e3 * statistics.median(self.seconds), 4), mean_batch=round(mean_batch, 2),
                   max_batch=max(self.batches), mean_context=round(mean_context, 1), steady_count=len(steady),
                   steady_mean_ms=round(1e3 * steady_mean, 4) if steady else None,
                   steady_median_ms=round(1e3 * statistics.median(steady), 4) if steady else None,
                   transition_ms=[round(1e3 * s, 3) for s in transitions[:self.TRANSITIONS_KEPT]])
        if weight_bytes is not None:
            floor = (weight_bytes + mean_batch * mean_context * kv_bytes) / ceiling.read_bytes_per_s()
            out.update(floor_ms_at_mean=round(1e3 * floor, 4), over_floor=round(total / count / floor, 2),
                       steady_over_floor=None if steady_mean is None else round(steady_mean / floor, 2))
        return out


def run_ours(bench, spec: Spec, n: int, prompts: list) -> Run:
    """Serve ``prompts`` with ``llama.Engine`` after its warm-up; every request at once."""
    model = bench.ours
    model.rotary_in_attention = spec.rotary_in_attention and model.fused is not None
    untuned = model.gemm.defaults() if model.gemm is not None and not spec.tune_products else contextlib.nullcontext()
    try:
        with untuned:  # products tuned by an earlier configuration are set aside for this one
            return _serve(bench, spec, n, prompts)
    finally:
        model.rotary_in_attention = model.fused is not None


def _serve(bench, spec: Spec, n: int, prompts: list) -> Run:
    from llama import Engine, GenerationRequest

    args = bench.args
    longest = args.max_prompt + args.max_new_tokens
    blocks = int(1.25 * n * -(-longest // args.block_size)) + 64
    engine = Engine(bench.ours, num_blocks=blocks, block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                    max_num_seqs=n, max_model_len=longest, cuda_graphs=spec.graphs, seed=args.seed,
                    async_scheduling=False if spec.sync else None,
                    graph_attention=spec.graph_attention, tune_products=spec.tune_products)
    start = time.perf_counter()
    engine.warm_up()
    # As HF's warm-up call: the whole workload's shapes once (other prompts of the same lengths, so
    # the prefix cache holds nothing the timed run can hit), a few tokens each.
    engine.run([GenerationRequest(("warm-up", i), p, args.hf_warmup_tokens)
                for i, p in enumerate(warm_up_prompts(prompts, bench.ours.config.vocab_size))])
    engine.reset_stats()
    warm = time.perf_counter() - start
    log = StepLog(engine)
    requests = [GenerationRequest(i, p, args.max_new_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    outputs = engine.run(requests)
    wall = time.perf_counter() - start
    s = engine.stats
    weight_bytes, kv_bytes = bench.floor if args.device == "gpu" else (None, None)
    detail = dict(
        num_blocks=engine.cache.num_blocks, block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=n, all_in_flight=max(log.batches, default=0) == n and s.preemptions == 0,
        steps=dict(s.steps), seconds={k: round(v, 4) for k, v in s.seconds.items()},
        graph_replays=s.graph_replays, kernel_paths=dict(s.kernel_paths), peak_blocks=s.peak_blocks,
        preemptions=s.preemptions, engine_wall_s=round(s.wall_seconds, 4),
        decode_steps=log.summary(prompts, [list(outputs[i]) for i in range(n)], weight_bytes, kv_bytes))
    if s.graph_replays:
        detail["decode_steps"]["graph_bucket_ms_per_replay"] = round(1e3 * s.seconds["graph"] / s.graph_replays, 4)
    tokens = [list(outputs[i]) for i in range(n)]
    short = [i for i, t in enumerate(tokens) if len(t) != args.max_new_tokens]
    if short:
        raise RuntimeError(f"ours: requests {short[:8]} generated other than {args.max_new_tokens} tokens")
    del engine, log
    bench_calls.release()
    return Run(spec, n, wall, warm, tokens, detail)


def cb_options(args, n: int, spec: Spec) -> tuple[dict, list, int]:
    """HF ``ContinuousBatchingConfig`` keywords for ``n`` requests in flight, the wanted ones the
    installed transformers lacks, and its page size (tokens of a cache block)."""
    import transformers

    cls = transformers.ContinuousBatchingConfig
    if dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
    else:
        fields = set(inspect.signature(cls).parameters)
    default = cls()
    page = getattr(default, "page_size", None) or getattr(default, "block_size", None) or 256
    per_request = -(-(args.max_prompt + args.max_new_tokens) // page) + 1
    wanted = dict(num_blocks=math.ceil(1.25 * n * per_request) + 8, max_batch_tokens=args.max_batch_tokens,
                  max_requests_per_batch=n, use_cuda_graph=spec.graphs, auto_switch_to_flash=False)
    if "flash" in spec.attn:  # the block table of the flash_attn_with_kvcache decode path
        wanted["max_blocks_per_request"] = per_request + per_request % 2
    kept = {k: v for k, v in wanted.items() if k in fields}
    return kept, sorted(set(wanted) - set(kept)), int(page)


def hf_generate(model, prompts, new_tokens: int, options: dict, persistent: bool) -> dict:
    """``model.generate_batch``: greedy, no EOS, ``new_tokens`` each, the keywords this
    transformers accepts (``persistent_manager`` keeps the manager, its cache and graphs)."""
    import torch
    import transformers

    params = inspect.signature(model.generate_batch).parameters
    extra = {k: v for k, v in (("persistent_manager", persistent), ("warmup", True), ("progress_bar", False))
             if k in params}
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                                           bos_token_id=BOS, eos_token_id=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24: "the paged| prefix is no longer needed"
        return model.generate_batch(prompts, generation_config=config,
                                    continuous_batching_config=transformers.ContinuousBatchingConfig(**options),
                                    **extra)


def _in_order(results: dict, n: int) -> list:
    """The outputs in the order of the prompts: ``generate_batch`` names its requests ``req_<k>``,
    ``k`` counting up in submission order (on across the calls of one manager)."""
    def number(key) -> int:
        tail = str(key).rsplit("_", 1)[-1]
        if not tail.isdigit():
            raise RuntimeError(f"generate_batch returned request id {key!r}, not req_<number>")
        return int(tail)

    if len(results) != n:
        raise RuntimeError(f"generate_batch returned {len(results)} results for {n} requests")
    return [results[k] for k in sorted(results, key=number)]


def _hf_tokens(results: dict, n: int, new_tokens: int) -> tuple[list, bool | None]:
    """Each request's tokens (checked: ``new_tokens`` each, no error) and whether all were in
    flight at once (every request started before the first finished; None where HF keeps no
    ``lifespan``)."""
    outputs = _in_order(results, n)
    errors = [f"{o.request_id}: {o.error}" for o in outputs if getattr(o, "error", None)]
    tokens = [list(o.generated_tokens) for o in outputs]
    short = [i for i, t in enumerate(tokens) if len(t) != new_tokens]
    if errors or short:
        raise RuntimeError(f"HF requests failed {errors[:3]} or did not generate exactly {new_tokens} tokens "
                           f"(requests {short[:8]}, lengths {[len(tokens[i]) for i in short[:8]]})")
    spans = [getattr(o, "lifespan", None) for o in outputs]
    if any(s is None or min(s) < 0 for s in spans):
        return tokens, None
    return tokens, max(s[0] for s in spans) < min(s[1] for s in spans)


def run_hf(bench, spec: Spec, n: int, prompts: list) -> Run:
    """Serve ``prompts`` with HF ``generate_batch``: an untimed warm-up call (``--hf-warmup-tokens``
    each, over :func:`warm_up_prompts`: all of them with graphs, two without) on a persistent
    manager, then the timed call on it.  The warm-up's prompts are not the timed ones: HF's
    continuous batching shares cached prompt blocks between calls of one manager
    (``allow_block_sharing``), and with the same prompts about 77% of the timed call's prompt
    tokens skipped their prefill."""
    args = bench.args
    model = bench.hf_model(spec.attn)
    options, dropped, page = cb_options(args, n, spec)
    persistent = "persistent_manager" in inspect.signature(model.generate_batch).parameters
    warm_up = bool(args.hf_warmup_tokens and persistent)
    try:
        start = time.perf_counter()
        if warm_up:
            others = warm_up_prompts(prompts if spec.graphs else prompts[:2], bench.ours.config.vocab_size)
            hf_generate(model, others, args.hf_warmup_tokens, options, persistent=True)
        warm = time.perf_counter() - start
        results, start, call = _timed_generate(model, prompts, args.max_new_tokens, options, persistent)
        lengths = {len(r.generated_tokens) for r in results.values()}
        if warm_up and lengths == {args.hf_warmup_tokens} != {args.max_new_tokens}:
            # a reused manager kept the warm-up's new-token count: time a fresh manager instead
            _destroy_manager(model)
            warm_up = False
            results, start, call = _timed_generate(model, prompts, args.max_new_tokens, options, False)
        tokens, in_flight = _hf_tokens(results, n, args.max_new_tokens)
        wall, timed = _served_seconds(results, start, call)
    finally:
        _destroy_manager(model)
        bench_calls.release()
    how = (f"untimed generate_batch of {'prompts of the same lengths' if spec.graphs else 'two such prompts'} "
           "(other tokens), "
           f"{args.hf_warmup_tokens} new tokens each, on a persistent manager reused by the timed call"
           if warm_up else "none: a fresh manager in the timed call (HF warmup=True)")
    detail = dict(attn_implementation=spec.attn, continuous_batching=options, dropped_options=dropped,
                  page_size=page, warm_up=how, all_in_flight=in_flight, timed=timed, call_wall_s=round(call, 3))
    return Run(spec, n, wall, warm, tokens, detail)


def _timed_generate(model, prompts, new_tokens, options, persistent):
    """The results, the ``perf_counter`` at the call and the call's seconds."""
    _sync()
    start = time.perf_counter()
    results = hf_generate(model, prompts, new_tokens, options, persistent)
    _sync()
    return results, start, time.perf_counter() - start


def _served_seconds(results: dict, start: float, call: float) -> tuple[float, str]:
    """Seconds from the call to the last request's finish (HF's ``lifespan``, on ``perf_counter``),
    which leaves out the manager's teardown after it (a thread join, ``gc.collect``,
    ``empty_cache``: about half a second on the CPU); the whole call where that is not kept."""
    ends = [getattr(r, "lifespan", (-1, -1))[1] for r in results.values()]
    if ends and all(start < end <= start + call for end in ends):
        return max(ends) - start, "from the generate_batch call to the last request's finish (HF lifespan)"
    return call, "the whole generate_batch call"


def _destroy_manager(model) -> None:
    """Drop the manager a persistent ``generate_batch`` cached on the model (its cache, graphs)."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()
        return
    manager = vars(model).pop("_cached_continuous_batching_manager", None)
    if manager is not None and hasattr(manager, "destroy"):
        manager.destroy()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def hf_cpu_memory(device: str):
    """On the CPU without psutil transformers finds 0 bytes for its cache (5.17) or cannot size
    it: 1 GiB then, for as long as this lasts (the runs pass ``num_blocks`` anyway)."""
    handler = None
    if device == "cpu" and importlib.util.find_spec("psutil") is None:
        from transformers.generation.continuous_batching import cache

        handler = getattr(cache, "PagedAttentionMemoryHandler", None)
    if handler is None or "get_available_memory" not in vars(handler):
        yield
        return
    original = vars(handler)["get_available_memory"]
    handler.get_available_memory = lambda self: 1 << 30
    try:
        yield
    finally:
        handler.get_available_memory = original


# ----------------------------------------------------------------------------------- the session

class Bench:
    """The session: the checkpoint, both engines' models, the runs so far and the report."""

    def __init__(self, args, folder: pathlib.Path, model_info: dict):
        self.args, self.folder, self.model_info = args, folder, model_info
        self.start = time.perf_counter()
        self.ours = None
        self.hf_models: dict = {}
        self.runs: dict = {}      # (key, n) -> Run
        self.skipped: list = []
        self.failed: dict = {}
        self.prompts: dict = {}
        self.floor = (None, None)

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {text}", flush=True)

    def hf_model(self, attn: str):
        """HF's model from the checkpoint folder with ``attn`` (loaded once per implementation)."""
        if attn not in self.hf_models:
            import transformers

            if "flash" in attn:
                from cupy_paged.integrations import transformers as cp_hf

                cp_hf.install()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    self.folder, attn_implementation=attn, dtype=torch_dtype(self.args))
            self.hf_models[attn] = model.to("cuda" if self.args.device == "gpu" else "cpu").eval()
        return self.hf_models[attn]

    def prompts_for(self, n: int) -> list:
        if n not in self.prompts:
            self.prompts[n] = make_prompts(self.args, n, self.ours.config.vocab_size)
        return self.prompts[n]

    def planned(self) -> list:
        """(key, n) in order: the targets' runs, the others at ``--concurrency`` (HF eager at the
        first), then the sweep points."""
        args, order = self.args, []
        for n in args.concurrency:
            order += [(k, n) for k in TARGET_KEYS if k in args.configs]
        for n in args.concurrency:
            order += [(k, n) for k in args.configs if k not in TARGET_KEYS and k != "hf-eager"]
        if "hf-eager" in args.configs:
            order.append(("hf-eager", args.concurrency[0]))
        for n in args.sweep:
            if n not in args.concurrency:
                order += [(k, n) for k in args.sweep_configs if k in args.configs]
        return order

    def predicted_seconds(self, key: str, n: int) -> float:
        """Warm-up plus timed seconds of a run: the same configuration's nearest measured run
        scaled by sqrt(n / its n), else the issue's rate (scaled alike) and 30% for warming up."""
        measured = [(m, r.wall_s + r.warm_s) for (k, m), r in self.runs.items() if k == key]
        if measured:
            m, seconds = min(measured, key=lambda item: abs(math.log(item[0] / n)))
            return seconds * math.sqrt(n / m)
        rate = SPECS[key].prior_tok_s * math.sqrt(n / 64)
        return 1.3 * n * self.args.max_new_tokens / rate

    def should_skip(self, key: str, n: int, elapsed: float | None = None) -> str | None:
        """Why run (key, n) is skipped (None: it runs), ``elapsed`` seconds into the session."""
        predicted = self.predicted_seconds(key, n)
        elapsed = time.perf_counter() - self.start if elapsed is None else elapsed
        if predicted > self.args.max_run_seconds:
            return f"predicted {predicted:.0f} s > --max-run-seconds {self.args.max_run_seconds:g}"
        if elapsed + predicted > self.args.max_seconds:
            return f"predicted {predicted:.0f} s would end past --max-seconds {self.args.max_seconds:g}"
        return None

    def run(self, key: str, n: int) -> None:
        spec = SPECS[key]
        name = f"{spec.label} {n}"
        reason = self.should_skip(key, n)
        if reason:
            self.skipped.append(dict(name=name, reason=reason))
            self.log(f"{name}: skipped ({reason})")
            return
        self.log(f"{name}: ...")
        try:
            runner = run_ours if spec.engine == "ours" else run_hf
            run = runner(self, spec, n, self.prompts_for(n))
        except Exception as error:  # noqa: BLE001 - a failing run is reported, the others go on
            traceback.print_exc()
            self.failed[name] = f"{type(error).__name__}: {str(error)[:400]}"
            self.log(f"{name}: FAILED ({self.failed[name][:200]})")
            bench_calls.release()
            return
        self.runs[(key, n)] = run
        agree = self.agreement(key, n)
        extra = f", median common prefix {agree['median_common_prefix']:g} vs {agree['vs']}" if agree else ""
        self.log(f"{name}: {run.tok_s:,.0f} tok/s (wall {run.wall_s:.2f} s, warm-up {run.warm_s:.1f} s{extra})")

    def agreement(self, key: str, n: int) -> dict | None:
        """Greedy agreement of run (key, n) with HF sdpa's run at ``n`` (no graphs, else graphs)."""
        ref = next((k for k in REFERENCES if k != key and (k, n) in self.runs), None)
        if ref is None or (key, n) not in self.runs:
            return None
        prefixes = [common_prefix(a, b) for a, b in zip(self.runs[(key, n)].tokens, self.runs[(ref, n)].tokens)]
        full = self.args.max_new_tokens
        return dict(vs=SPECS[ref].label, median_common_prefix=float(statistics.median(prefixes)),
                    mean_common_prefix=round(statistics.fmean(prefixes), 2),
                    fraction_equal=round(sum(p == full for p in prefixes) / len(prefixes), 4), of_tokens=full)

    def targets(self) -> list[dict]:
        """The issue's targets for ours with graphs (GPU mode): rates and ratios to HF's graph runs."""
        if self.args.device != "gpu":
            return []
        out = []
        for n, rate in RATE_TARGETS.items():
            run = self.runs.get(("ours-graphs", n))
            out.append(dict(name=f"ours graphs {n} >= {rate:,.0f} tok/s", concurrency=n, target=rate,
                            value=None if run is None else round(run.tok_s, 1),
                            met=None if run is None else run.tok_s >= rate))
        for n in RATE_TARGETS:
            for peer, ratio in RATIO_TARGETS.items():
                ours, other = self.runs.get(("ours-graphs", n)), self.runs.get((peer, n))
                value = None if ours is None or other is None else ours.tok_s / other.tok_s
                out.append(dict(name=f"ours graphs {n} >= {ratio:g}x {SPECS[peer].label}", concurrency=n,
                                target=ratio, value=None if value is None else round(value, 2),
                                met=None if value is None else value >= ratio))
        return out

    def case(self, key: str, n: int, run: Run) -> dict:
        """The JSON row of one run: tok/s, the other configurations at ``n`` as peers, agreement,
        the run's own detail; ours with graphs also carries its targets."""
        peers = {SPECS[k].label: round(r.tok_s, 1) for (k, m), r in self.runs.items() if m == n and k != key}
        row = dict(name=f"{SPECS[key].label} {n}", config=key, concurrency=n, metric="tok/s", value=round(run.tok_s, 1),
                   peers=peers, wall_s=round(run.wall_s, 3), warm_up_s=round(run.warm_s, 2), requests=n,
                   generated_tokens=run.generated, prompt_tokens=sum(map(len, self.prompts[n])),
                   agreement=self.agreement(key, n), **run.detail)
        goals = [t for t in self.targets() if t["concurrency"] == n] if key == "ours-graphs" else []
        if goals:
            row["target"] = "; ".join(t["name"] for t in goals)
            row["met"] = None if any(t["met"] is None for t in goals) else all(t["met"] for t in goals)
        return row

    def cpu_check(self) -> dict:
        """CPU mode: ours and HF sdpa give every request the same greedy tokens (float32); None
        when the two did not both run."""
        mismatched, compared = [], 0
        for n in sorted({n for _, n in self.runs}):
            ours, sdpa = self.runs.get(("ours", n)), self.runs.get(("hf-sdpa", n))
            if ours is None or sdpa is None:
                continue
            compared += n
            mismatched += [[n, i] for i, (a, b) in enumerate(zip(ours.tokens, sdpa.tokens)) if a != b]
        return dict(requests_compared=compared, mismatched=mismatched,
                    ours_equals_hf_sdpa=not mismatched if compared else None)

    def report(self) -> dict:
        args = self.args
        rows = sorted(self.runs.items(), key=lambda item: (item[0][1], list(SPECS).index(item[0][0])))
        counts = sorted({n for _, n in self.runs})
        agreement = {str(n): {SPECS[k].label: self.agreement(k, n) for (k, m) in self.runs
                              if m == n and self.agreement(k, n)} for n in counts}
        weight_bytes, kv_bytes = self.floor
        out = dict(device=device_name(args), date=datetime.date.today().isoformat(), versions=versions(),
                   mode=args.device, model=self.model_info,
                   workload=dict(concurrency=args.concurrency, sweep=args.sweep, seed=args.seed,
                                 prompt_tokens=[args.min_prompt, args.max_prompt], max_new_tokens=args.max_new_tokens,
                                 sampling="greedy", eos="none: every request generates max_new_tokens",
                                 max_batch_tokens=args.max_batch_tokens, hf_warmup_tokens=args.hf_warmup_tokens,
                                 weight_layout=args.weight_layout),
                   floor=dict(read_bytes_per_s=ceiling.read_bytes_per_s(), weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes,
                              what="per decode step: every layer's matrices and the LM head once, plus the K/V "
                                   "of the running sequences' contexts"),
                   cases=[self.case(key, n, run) for (key, n), run in rows], agreement=agreement,
                   targets=self.targets(), skipped=self.skipped, failed=self.failed,
                   elapsed_s=round(time.perf_counter() - self.start, 1))
        if args.device == "cpu":
            out["cpu_check"] = self.cpu_check()
        tuned = getattr(self.ours, "tuned_products", {}) if self.ours is not None else {}
        out["tuned_products"] = {f"M={rows} {name}": report for (rows, name), report in sorted(tuned.items())
                                 if "gemmex_us" in report}
        return out


def device_name(args) -> str:
    return bench_calls.device_name() if args.device == "gpu" else cpu_name()


def versions() -> dict:
    """The other benchmarks' versions (``bench_calls.versions``), transformers with them."""
    import transformers

    return {**bench_calls.versions(), "transformers": transformers.__version__}


# ----------------------------------------------------------------------------------- output

def plot(report: dict, path: pathlib.Path) -> None:
    """tok/s against concurrency (log2 x, log y), one line per configuration, the targets as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, spec in SPECS.items():
        points = sorted((c["concurrency"], c["value"]) for c in report["cases"] if c["config"] == key)
        if points:
            family = "ours" if spec.engine == "ours" else spec.attn.split("|")[-1]
            ax.plot(*zip(*points), marker="o", ls="-" if spec.graphs else "--", label=spec.label,
                    color={"ours": "C0", "flash_attention_2": "C1", "sdpa": "C2"}.get(family, "C3"))
    if report["mode"] == "gpu":
        ax.scatter(list(RATE_TARGETS), list(RATE_TARGETS.values()), marker="*", s=160, c="k",
                   label="target, ours graphs")
    counts = sorted({c["concurrency"] for c in report["cases"]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("requests served at once")
    ax.set_ylabel("generated tokens / s")
    m = report["model"]
    ax.set_title(f"{report['device']}: Llama {m.get('layers')} layers, hidden {m.get('hidden')}, {m.get('dtype')}; "
                 f"prompts {report['workload']['prompt_tokens']}, {report['workload']['max_new_tokens']} new tokens",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_tables(report: dict) -> None:
    """The markdown tables: every run (``ours / this``: ours with graphs where it ran, else without),
    the targets, ours' decode steps against their floor."""
    tok = {(c["config"], c["concurrency"]): c["value"] for c in report["cases"]}
    print("\n| requests | configuration | tok/s | wall s | whole call s | ours / this | common prefix vs sdpa "
          "(median of tokens) | fully equal |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for c in report["cases"]:
        best = tok.get(("ours-graphs", c["concurrency"])) or tok.get(("ours", c["concurrency"]))
        a = c["agreement"]
        agree = "-" if a is None else f"{a['median_common_prefix']:g} of {a['of_tokens']} ({a['vs']})"
        equal = "-" if a is None else f"{100 * a['fraction_equal']:.0f}%"
        print(f"| {c['concurrency']} | {SPECS[c['config']].label} | {_fmt(c['value'])} | {c['wall_s']:.2f} "
              f"| {c.get('call_wall_s', c['wall_s']):.2f} | {_fmt(best / c['value'] if best else None, 2)} "
              f"| {agree} | {equal} |")
    if report["targets"]:
        print("\n| target | value | met? |\n| --- | ---: | --- |")
        for t in report["targets"]:
            met = {True: "yes", False: "**no**", None: "?"}[t["met"]]
            print(f"| {t['name']} | {_fmt(t['value'], 2)} | {met} |")
    # "steady": the decode steps whose step() call waited for a decode step, not for the rest of
    # a prefill or mixed step launched before it (StepLog.summary); older results lack them.
    print("\n| run | decode steps | mean step ms | steady mean ms | floor ms at mean | x floor | steady x floor "
          "| mean batch | mean context |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in report["cases"]:
        d = c.get("decode_steps")
        if d and d.get("count"):
            print(f"| {c['name']} | {d['count']} | {d['mean_ms']:.3f} | {_fmt(d.get('steady_mean_ms'), 3)} "
                  f"| {_fmt(d.get('floor_ms_at_mean'), 3)} | {_fmt(d.get('over_floor'), 2)} "
                  f"| {_fmt(d.get('steady_over_floor'), 2)} | {d['mean_batch']:.1f} | {d['mean_context']:.0f} |")
    tuned = report.get("tuned_products") or {}
    if tuned:  # per decode-graph batch size: a step's products (8 layers of four, the LM head) timed
        layers = report["model"].get("layers", 1)
        steps: dict = {}
        for name, r in tuned.items():
            rows, product = name.split()
            weight = 1 if product == "lm_head" else layers
            acc = steps.setdefault(rows, [0.0, 0.0, []])
            acc[0] += weight * r["gemmex_us"]
            acc[1] += weight * r["chosen_us"]
            acc[2].append(f"{product} {r['gemmex_us']:.2f}->{r['chosen_us']:.2f} ({r['chosen']})")
        print("\n| decode batch | a step's products, cuBLAS default us | tuned us | each (default -> tuned, kernel) |")
        print("| --- | ---: | ---: | --- |")
        for rows, (default, chosen, each) in sorted(steps.items(), key=lambda item: int(item[0][2:])):
            print(f"| {rows} | {default:.1f} | {chosen:.1f} | {'; '.join(each)} |")
    for s in report["skipped"]:
        print(f"skipped: {s['name']} ({s['reason']})")
    for name, error in report["failed"].items():
        print(f"FAILED: {name}: {error}")


def print_plan(bench: Bench, setup_seconds: float = 40.0) -> None:
    """The planned runs in order with their predicted seconds (the issue's rates), and which the
    budget would skip, after ``setup_seconds`` of set-up."""
    elapsed = setup_seconds
    for key, n in bench.planned():
        seconds = bench.predicted_seconds(key, n)
        reason = bench.should_skip(key, n, elapsed)
        elapsed += 0.0 if reason else seconds
        print(f"{SPECS[key].label} {n}: ~{seconds:.0f} s" + (f"  (skipped: {reason})" if reason else ""))
    print(f"about {elapsed:.0f} s in all, {setup_seconds:.0f} s of set-up included")


def write(report: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def _uninstall_integration() -> None:
    module = sys.modules.get("cupy_paged.integrations.transformers")
    if module is not None:
        module.uninstall()


def setup(args, stack: contextlib.ExitStack, start: float) -> Bench:
    """The checkpoint (built into a temporary folder unless ``--checkpoint``), our model on it."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its own logger, not HF's
    if args.checkpoint:
        folder, info = args.checkpoint, dict(source=str(args.checkpoint))
    else:
        folder = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_e2e_")))
        check = build_checkpoint(args, folder)
        info = dict(source=f"random weights: HF LlamaForCausalLM's own initialisation, torch.manual_seed({args.seed})",
                    init_check=check)
    stack.enter_context(hf_cpu_memory(args.device))
    stack.callback(_uninstall_integration)
    bench = Bench(args, folder, info)
    bench.start = start
    bench.ours = load_ours(args, folder)
    c = bench.ours.config
    info.update(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                vocab=c.vocab_size, dtype=np.dtype(bench.ours.dtype).name)
    bench.floor = floor_bytes(c, np.dtype(bench.ours.dtype).itemsize)
    bench.log(f"model: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
              f"{c.num_key_value_heads} x {c.head_dim}, vocab {c.vocab_size}, {info['dtype']} ({info['source']})")
    return bench


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    if args.list:
        print_plan(Bench(args, args.checkpoint, {}))
        return 0
    if args.report:
        report = json.loads(args.report.read_text())
        if not args.no_plot:
            plot(report, args.report.with_suffix(".png"))
        print_tables(report)
        return 0
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"bench_e2e needs {' and '.join(missing)}")
    with contextlib.ExitStack() as stack:
        bench = setup(args, stack, start)
        for key, n in bench.planned():
            bench.run(key, n)
            write(bench.report(), args.out)
        report = bench.report()
        write(report, args.out)
    bench.log(f"wrote {args.out}")
    if not args.no_plot and report["cases"]:
        try:
            plot(report, args.out.with_suffix(".png"))
            bench.log(f"wrote {args.out.with_suffix('.png')}")
        except ImportError as error:
            bench.log(f"no plot: {error}")
    print_tables(report)
    status = 1 if report["failed"] else 0
    if args.device == "cpu":
        check = report["cpu_check"]
        verdict = {True: "all equal", False: "MISMATCH", None: "not compared (both must run)"}
        print(f"\nCPU check, greedy tokens of ours and hf sdpa: {verdict[check['ours_equals_hf_sdpa']]} "
              f"({check['requests_compared']} requests; mismatched {check['mismatched']})")
        status = status or int(check["ours_equals_hf_sdpa"] is False)
    return status


if __name__ == "__main__":
    sys.exit(main())
