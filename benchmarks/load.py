"""Load through the real kernels (issue 16, point 6): thousands of requests served by
``cupy_paged.Scheduler`` and ``StepPlan.attention`` with a cache small enough to force
preemption, random aborts, parallel samples (``n`` > 1), stop tokens and shared prompt prefixes;
every request's greedy tokens checked against the same model run for that request alone.

The model is a two-layer transformer of random weights (learned positions, GQA attention through
the plan, residual adds, a vocabulary head): its products run on the array library of the cache
(CuPy on the GPU, in float32, the K/V in float16; NumPy on the CPU backend, in float32), its
attention through the kernels.  The run alone is a dense float64 recomputation of each request
(no cache, no paging, no other request), batched over requests only for speed.

The check of each request, completed or aborted, up to the end of its tokens or of the run
alone's:

* the logits of every generated token agree with the run alone's within the dtype's tolerance
  (``--rtol`` of the row's largest logit), so a wrong block or slot shows even where the argmax
  survives it;
* the tokens are equal, except that from a position where the run alone's two best logits are
  within twice that tolerance of each other (a near tie, which either token may win) the rest
  is not compared;
* a completed request has the run alone's length (its stop token or ``max_new_tokens``), an aborted
  one at most that length; every branch comes back once, completed or aborted;
* at the end no request is live, every block is free and no block has a reference left.

    python benchmarks/load.py                     # 10,000 requests on the GPU
    python benchmarks/load.py --device cpu --requests 300

Writes ``benchmarks/results/load.json`` (``--out``): the counts of the run (requests, completed,
aborted, near ties, mismatches, preemptions, steps, prefix-cache hits) as cases.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupy_paged  # noqa: E402
from cupy_paged import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402
from cupy_paged.serving.kv_cache import PagedAttentionCache  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 256
    max_positions: int = 96

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


class LoadModel:
    """Random weights (float64 masters) and a forward pass over a step plan."""

    def __init__(self, shape: Shape, xp, kv_dtype, seed: int = 0):
        rng = np.random.default_rng(seed)
        s, w = shape, shape.width
        kv = s.kv_heads * s.head_dim
        self.shape, self.xp, self.kv_dtype = shape, xp, np.dtype(kv_dtype)
        self.master = dict(
            embed=rng.standard_normal((s.vocab, w)), position=rng.standard_normal((s.max_positions, w)),
            layers=[dict(q=rng.standard_normal((w, w)) / np.sqrt(w), k=rng.standard_normal((w, kv)) / np.sqrt(w),
                         v=rng.standard_normal((w, kv)) / np.sqrt(w), o=rng.standard_normal((w, w)) / np.sqrt(w))
                    for _ in range(s.layers)],
            head=rng.standard_normal((w, s.vocab)) / np.sqrt(w))
        self.weights = self._on(xp, np.float32)

    def _on(self, xp, dtype):
        m = self.master
        return dict(embed=xp.asarray(m["embed"], dtype), position=xp.asarray(m["position"], dtype),
                    layers=[{k: xp.asarray(v, dtype) for k, v in layer.items()} for layer in m["layers"]],
                    head=xp.asarray(m["head"], dtype))

    def forward(self, plan, cache):
        """``[num_samples, vocab]`` float32 logits of the step, in ``plan.sample_requests`` order."""
        xp, s, w = self.xp, self.shape, self.weights
        ids, positions = xp.asarray(plan.input_ids), xp.asarray(plan.positions)
        x = w["embed"][ids] + w["position"][positions]
        t = x.shape[0]
        for i, layer in enumerate(w["layers"]):
            q = (x @ layer["q"]).reshape(t, s.heads, s.head_dim).astype(self.kv_dtype)
            k = (x @ layer["k"]).reshape(t, s.kv_heads, s.head_dim).astype(self.kv_dtype)
            v = (x @ layer["v"]).reshape(t, s.kv_heads, s.head_dim).astype(self.kv_dtype)
            out = plan.attention(q, k, v, *cache.layer(i))
            x = x + out.reshape(t, s.width).astype(np.float32) @ layer["o"]
        rows = xp.asarray(plan.logits_indices)
        if plan.sample_rows is not None:
            rows = rows[xp.asarray(plan.sample_rows)]
        return x[rows] @ w["head"]


def run_alone(model: LoadModel, requests: list, xp, chunk: int = 1024) -> dict:
    """Each request's greedy tokens and logits with nothing else running: dense float64 attention
    over its own tokens, requests batched ``chunk`` at a time (each row masked to its own
    sequence).  Returns ``{request_id: (tokens, logits [len(tokens), vocab] float64 on the host)}``."""
    s, w = model.shape, model._on(xp, np.float64)
    scale = 1.0 / np.sqrt(s.head_dim)
    group = s.heads // s.kv_heads
    results = {}
    for first in range(0, len(requests), chunk):
        part = requests[first:first + chunk]
        r = len(part)
        lens = np.array([len(q.prompt_token_ids) for q in part])
        limits = np.array([q.max_new_tokens for q in part])
        total = int((lens + limits).max())
        tokens = np.zeros((r, total), np.int64)
        for i, q in enumerate(part):
            tokens[i, :lens[i]] = q.prompt_token_ids
        keys = [xp.zeros((r, total, s.kv_heads, s.head_dim)) for _ in range(s.layers)]
        values = [xp.zeros((r, total, s.kv_heads, s.head_dim)) for _ in range(s.layers)]
        done = np.zeros(r, bool)
        out_tokens = [[] for _ in range(r)]
        out_logits = [[] for _ in range(r)]
        # Step 0 feeds every prompt whole; step j >= 1 feeds the token generated last.
        for step in range(int(limits.max())):
            if step == 0:
                feed_len = int(lens.max())
                pos = np.tile(np.arange(feed_len), (r, 1))
                valid = pos < lens[:, None]
                ids = tokens[:, :feed_len]
            else:
                feed_len = 1
                pos = (lens + step - 1)[:, None]
                valid = ~done[:, None]
                ids = tokens[np.arange(r), np.minimum(pos[:, 0], total - 1)][:, None]
            pos_c = np.minimum(pos, total - 1)
            x = w["embed"][xp.asarray(ids)] + w["position"][xp.asarray(pos_c)]          # [r, f, width]
            ctx = xp.asarray(pos_c[:, :, None] >= np.arange(total)[None, None, :])      # causal over own tokens
            ctx &= xp.asarray(valid[:, :, None])
            rows_i = xp.asarray(np.arange(r)[:, None].repeat(feed_len, 1))
            pos_d = xp.asarray(pos_c)
            write = xp.asarray(valid)
            for i, layer in enumerate(w["layers"]):
                q = (x @ layer["q"]).reshape(r, feed_len, s.kv_heads, group, s.head_dim)
                k = (x @ layer["k"]).reshape(r, feed_len, s.kv_heads, s.head_dim)
                v = (x @ layer["v"]).reshape(r, feed_len, s.kv_heads, s.head_dim)
                keep_k, keep_v = keys[i][rows_i, pos_d], values[i][rows_i, pos_d]
                keys[i][rows_i, pos_d] = xp.where(write[..., None, None], k, keep_k)
                values[i][rows_i, pos_d] = xp.where(write[..., None, None], v, keep_v)
                scores = xp.einsum("rfhgd,rthd->rfhgt", q, keys[i]) * scale
                scores = xp.where(ctx[:, :, None, None, :], scores, -xp.inf)
                with np.errstate(invalid="ignore"):  # rows with nothing to attend (past a finished request)
                    scores -= scores.max(-1, keepdims=True)
                    p = xp.exp(scores)
                    p = xp.nan_to_num(p / p.sum(-1, keepdims=True))
                att = xp.einsum("rfhgt,rthd->rfhgd", p, values[i]).reshape(r, feed_len, s.width)
                x = x + att @ layer["o"]
            last = (lens - 1) if step == 0 else np.zeros(r, np.int64)
            logits = x[xp.arange(r), xp.asarray(last)] @ w["head"]
            logits = logits.get() if hasattr(logits, "get") else logits
            new = logits.argmax(-1)
            for i in np.flatnonzero(~done):
                out_tokens[i].append(int(new[i]))
                out_logits[i].append(logits[i])
                tokens[i, lens[i] + step] = new[i]
                if new[i] in part[i].stop_token_ids or len(out_tokens[i]) == limits[i]:
                    done[i] = True
            if done.all():
                break
        for i, q in enumerate(part):
            results[q.request_id] = (out_tokens[i], np.array(out_logits[i]))
    return results


def draw_requests(rng, count: int, shape: Shape) -> list:
    """Prompts from 16 shared stems (prefix-cache hits) plus a random tail, 1..16 new tokens,
    some with stop tokens, some with ``n`` = 2 or 3 greedy samples."""
    stems = [rng.integers(0, shape.vocab, 48).tolist() for _ in range(16)]
    requests = []
    for i in range(count):
        prompt = stems[i % 16][:int(rng.integers(0, 49))] + rng.integers(0, shape.vocab, int(rng.integers(1, 17))).tolist()
        new = int(rng.integers(1, 17))
        new = min(new, shape.max_positions - len(prompt))
        stops = rng.integers(0, shape.vocab, int(rng.integers(0, 3))).tolist() if rng.random() < 0.3 else []
        n = int(rng.integers(2, 4)) if rng.random() < 0.05 else 1
        requests.append(Request(i, prompt, new, sampling=SamplingParams(temperature=0.0, stop_token_ids=stops, n=n)))
    return requests


def serve(model: LoadModel, scheduler, requests: list, rng, abort_rate: float, corrupt_at: int | None = None) -> dict:
    """Serve ``requests`` (half queued at once, the rest 0 to 8 a step), aborting a random live
    request with probability ``abort_rate`` before each step; returns the outputs and logits per
    branch.  ``corrupt_at``: after that step, overwrite the first layer's cached keys with noise
    (what the check must catch)."""
    logits_of, finished, aborted = {}, [], []
    later = requests[len(requests) // 2:][::-1]
    for request in requests[:len(requests) // 2]:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished() or later:
        for _ in range(len(later) if not scheduler.has_unfinished() else int(rng.integers(0, 9))):
            if later:
                scheduler.add_request(later.pop())
        if rng.random() < abort_rate:
            live = scheduler.running or scheduler.waiting
            if live:
                victim = live[int(rng.integers(0, len(live)))]
                aborted.extend(scheduler.abort([victim.request_id]))
        plan = scheduler.schedule()
        if plan is None:
            if not scheduler.has_unfinished():
                continue
            raise RuntimeError("the scheduler could schedule nothing while requests are unfinished")
        steps += 1
        logits = model.forward(plan, scheduler.cache)
        host = logits.get() if hasattr(logits, "get") else np.asarray(logits)
        for request, row in zip(plan.sample_requests, host):
            logits_of.setdefault(request.request_id, []).append(row)
        finished.extend(scheduler.update(plan, host.argmax(-1)))
        if steps == corrupt_at:
            k_cache = scheduler.cache.layer(0)[0]
            k_cache[...] = model.xp.asarray(rng.standard_normal(k_cache.shape), k_cache.dtype)
    return dict(finished=finished, aborted=aborted, logits=logits_of, steps=steps)


def check(served: dict, alone: dict, rtol: float) -> dict:
    """Compare every branch with the run alone of its request (the module docstring's rules)."""
    counts = dict(completed=0, aborted=0, near_ties=0, mismatches=0, compared_tokens=0, worst_logit_err=0.0)
    failures = []
    for kind, branches in (("completed", served["finished"]), ("aborted", served["aborted"])):
        for branch in branches:
            counts[kind] += 1
            base = branch.request_id[0] if isinstance(branch.request_id, tuple) else branch.request_id
            ref_tokens, ref_logits = alone[base]
            got = branch.output_token_ids
            logits = np.array(served["logits"].get(branch.request_id, []))
            problem = None
            if len(got) > len(ref_tokens) or len(logits) != len(got):
                problem = f"{len(got)} tokens ({len(logits)} logit rows) against {len(ref_tokens)} alone"
            for j in range(min(len(got), len(ref_tokens))):
                if problem:
                    break
                tol = rtol * max(1.0, float(np.abs(ref_logits[j]).max()))
                err = float(np.abs(logits[j] - ref_logits[j]).max())
                if not np.isfinite(err) or err > tol:
                    problem = f"token {j}: logits differ by {err:.3g} (tolerance {tol:.3g})"
                    break
                counts["worst_logit_err"] = max(counts["worst_logit_err"], err / tol * rtol)  # of the row's scale
                counts["compared_tokens"] += 1
                if got[j] != ref_tokens[j]:
                    top = np.sort(ref_logits[j])[-2:]
                    if top[1] - top[0] <= 2 * tol:
                        counts["near_ties"] += 1
                        break
                    problem = f"token {j}: {got[j]} against {ref_tokens[j]} alone (margin {top[1] - top[0]:.3g})"
            else:  # every token compared and equal
                if not problem and kind == "completed" and len(got) != len(ref_tokens):
                    problem = f"finished after {len(got)} tokens, alone after {len(ref_tokens)}"
            if problem:
                counts["mismatches"] += 1
                failures.append(f"{kind} request {branch.request_id!r}: {problem}")
    return dict(counts=counts, failures=failures)


def run(device: str, num_requests: int, seed: int = 0, abort_rate: float = 0.05, num_blocks: int = 96,
        block_size: int = 16, max_num_seqs: int = 48, max_batch_tokens: int = 512, rtol: float | None = None,
        corrupt_at: int | None = None, kv_dtype=None) -> dict:
    """Build the cache, scheduler and model on ``device``, serve, run alone, check; returns the
    report (``counts``, ``failures``, scheduler statistics, seconds).  ``kv_dtype``: of the K/V
    and the attention (default float16 on the GPU, float32 on the CPU); ``rtol``: of the logits
    (default 1e-2 for 16-bit K/V, 1e-4 for float32)."""
    xp = np
    if device == "cuda":
        import cupy as xp
    kv_dtype = np.dtype(kv_dtype or (np.float16 if device == "cuda" else np.float32))
    rtol = rtol or {2: 1e-2, 4: 1e-4}[kv_dtype.itemsize]
    shape = Shape()
    rng = np.random.default_rng(seed)
    model = LoadModel(shape, xp, kv_dtype, seed)
    cache = PagedAttentionCache(shape.layers, shape.kv_heads, shape.head_dim, block_size=block_size,
                                num_blocks=num_blocks, dtype=kv_dtype, device=device,
                                max_blocks_per_seq=-(-shape.max_positions // block_size))
    scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs))
    requests = draw_requests(rng, num_requests, shape)
    start = time.perf_counter()
    served = serve(model, scheduler, requests, rng, abort_rate, corrupt_at)
    served_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = run_alone(model, requests, xp)
    alone_s = time.perf_counter() - start
    report = check(served, alone, rtol)
    wanted = {r.request_id for r in requests} | {(r.request_id, k) for r in requests for k in range(1, r.sampling.n)}
    came = [b.request_id for b in served["finished"] + served["aborted"]]
    report["counts"].update(lost=len(wanted - set(came)), returned_twice=len(came) - len(set(came)))
    stats = scheduler.stats()
    leaks = dict(live=len(cache), free_blocks=cache.num_free_blocks, num_blocks=cache.num_blocks,
                 referenced_blocks=int((cache.pool.ref_counts != 0).sum()))
    report.update(device=device, requests=num_requests, branches=sum(r.sampling.n for r in requests),
                  steps=served["steps"], preemptions=scheduler.num_preemptions,
                  cached_prompt_tokens=stats.cached_prompt_tokens, prompt_tokens=stats.prompt_tokens,
                  leaks=leaks, served_s=served_s, alone_s=alone_s, rtol=rtol)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--abort-rate", type=float, default=0.05)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "load.json")
    args = p.parse_args(argv)
    report = run(args.device, args.requests, args.seed, args.abort_rate)
    c = report["counts"]
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    for line in report["failures"][:20]:
        print("FAILED", line)
    ok = not report["failures"] and not c["lost"] and not c["returned_twice"] and report["leaks"]["live"] == 0 and report["leaks"]["referenced_blocks"] == 0 \
        and report["leaks"]["free_blocks"] == report["leaks"]["num_blocks"]
    cases = [dict(name="load", metric=k, value=v, peers={}) for k, v in c.items()]
    cases += [dict(name="load", metric=k, value=report[k], peers={})
              for k in ("requests", "branches", "steps", "preemptions", "cached_prompt_tokens", "served_s")]
    cases += [dict(name="load", metric="leaked_blocks",
                   value=report["leaks"]["num_blocks"] - report["leaks"]["free_blocks"], peers={})]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=args.device, date=datetime.date.today().isoformat(),
                                        cupy_paged=cupy_paged.__version__, cases=cases), indent=1) + "\n")
    print(f"{report['requests']} requests ({report['branches']} branches): {c['completed']} completed, "
          f"{c['aborted']} aborted, {c['mismatches']} mismatches, {c['near_ties']} near ties, "
          f"{report['preemptions']} preemptions, {report['steps']} steps; {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
