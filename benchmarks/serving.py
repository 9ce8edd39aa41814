"""Serving under load: Poisson arrivals at several request rates against a running `specserve
serve`, with speculation on and off, and the HTTP overhead on time to first token.

The script starts the server (a subprocess: the load generator must not share its interpreter)
on Spec-Bench prompts (round-robin over the categories, chat template), then per request rate
sends `--requests` streaming completions at exponentially distributed gaps (seeded, the same
schedule for both), once with speculation on and once off (`"speculation": {"enabled": false}`
per request, so the server and its state are the same), alternating which goes first. Per
request it records time to first token (TTFT), inter-token latencies (ITL, between streamed
chunks: a chunk may carry several accepted tokens), time per output token (TPOT, after the
first) and end-to-end latency; per run, generated tokens per second from the first send to the
last finish. Last, the HTTP overhead: TTFT of one request at a time through HTTP against the
offline engine's TTFT (`LLMEngine` in this process, same model and prompts), medians.

    python benchmarks/serving.py [--rates 0.5,1,2,4] [--requests 32] [--max-tokens 64]

Writes `results/serving.{json,md}` and `results/serving.png` (latency and throughput by rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from engine import SPEC_BENCH, load_prompts, percentiles  # benchmarks/engine.py
from report import write_report
from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import free_port
from specserve.pull import resolve_model
from specserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"




def add_server_arguments(parser: argparse.ArgumentParser, dtype: str, kv_cache_memory: str) -> None:
    """What `start_server` starts: the model, its drafter, dtype and KV pool."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--dtype", default=dtype, choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-memory", default=kv_cache_memory)


def start_server(args: argparse.Namespace, port: int, extra: list[str] = (), log=subprocess.PIPE) -> subprocess.Popen:
    """`specserve serve` with the model, dtype, drafter and KV pool of `args` (plus `extra` flags),
    once /health answers; its log to `log` (a file, or a pipe read if it fails to start)."""
    command = [sys.executable, "-m", "specserve.cli", "serve", "--target", args.model, "--dtype", args.dtype,
               "--draft", args.draft, "--port", str(port), "--served-model-name", "bench", "--log-level", "warning",
               "--kv-cache-memory", args.kv_cache_memory, *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read() if process.stderr else 'see its log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start within 10 minutes")


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """POST a streaming `/v1/completions`: its send and end times, the time and text of every chunk
    that carries text, and the `completion_tokens` of the usage it streams (None if none)."""
    sent = time.perf_counter()
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                chunk_times.append(time.perf_counter())
                pieces.append(chunk["choices"][0]["text"])
    return {"sent": sent, "done": time.perf_counter(), "chunk_times": chunk_times, "text": "".join(pieces),
            "usage": usage}


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      speculation: bool) -> dict:
    """A streaming completion: its send time, first-token and per-chunk times, tokens."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            **({} if speculation else {"speculation": {"enabled": False}})}
    streamed = await stream_completion(client, url, body)
    sent, done, chunk_times = streamed["sent"], streamed["done"], streamed["chunk_times"]
    tokens = streamed["usage"] or 0
    ttft = chunk_times[0] - sent if chunk_times else float("nan")
    return {"sent": sent, "done": done, "tokens": tokens, "ttft": ttft, "e2e": done - sent,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
            "tpot": (done - chunk_times[0]) / (tokens - 1) if tokens > 1 and chunk_times else float("nan")}


async def run_rate(url: str, prompts: list[list[int]], rate: float, max_tokens: int, speculation: bool,
                   seed: int) -> dict:
    """Poisson arrivals at `rate` requests per second; every request's record and the totals."""
    gaps = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, prompt, max_tokens, speculation)))
            await asyncio.sleep(gaps.expovariate(rate))
        records = await asyncio.gather(*tasks)
    span = max(r["done"] for r in records) - start
    return {"rate": rate, "speculation": speculation, "tok_s": sum(r["tokens"] for r in records) / span,
            "ttft": percentiles([r["ttft"] for r in records]), "tpot": percentiles([r["tpot"] for r in records]),
            "itl": percentiles([gap for r in records for gap in r["itl"]]),
            "e2e": percentiles([r["e2e"] for r in records]), "requests": len(records)}


def http_ttft(url: str, prompts: list[list[int]]) -> list[float]:
    """TTFT through HTTP, one request at a time (no load), speculation off (as the engine's below)."""
    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=None) as client:
            return [(await one_request(client, url, p, 2, speculation=False))["ttft"] for p in prompts]
    return asyncio.run(run())


def offline_ttft(engine: LLMEngine, prompts: list[list[int]]) -> list[float]:
    """The engine's own TTFT for the same requests (first token's time from its arrival)."""
    times = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ttft-{i}", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                               speculation={"enabled": False}))
        while True:
            outs = [o for o in engine.step() if o.request_id == f"ttft-{i}"]
            if outs and outs[0].metrics.ttft_s is not None:
                times.append(outs[0].metrics.ttft_s)
                engine.abort(f"ttft-{i}")
                break
    return times


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for speculation, style in ((True, "o-"), (False, "s--")):
        rs = sorted((r for r in runs if r["speculation"] == speculation), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rs]
        label = "speculation on" if speculation else "speculation off"
        axes[0].plot(rates, [r["ttft"]["p50"] * 1000 for r in rs], style, label=label)
        axes[1].plot(rates, [r["tpot"]["p50"] * 1000 for r in rs], style, label=label)
        axes[2].plot(rates, [r["tok_s"] for r in rs], style, label=label)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TPOT p50 (ms)", "generated tok/s"), strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(parser, dtype="bfloat16", kv_cache_memory="1GiB")
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests per second, comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per rate and setting")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-prompts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "serving"))
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    engine = LLMEngine(resolve_model(args.model), args.dtype, EngineConfig(speculation="off", kv_cache_memory="256MiB"))
    prompts = load_prompts(engine, SPEC_BENCH, args.requests, max_prompt_tokens=384)
    port = free_port()
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        # Warm-up, both settings, at the middle rate and full length: the first step of each new
        # batch shape builds its matmul kernels, and the speculating engine meets more shapes.
        for speculation in (True, False):
            asyncio.run(run_rate(url, prompts[:16], rates[len(rates) // 2], args.max_tokens, speculation, args.seed))
        runs = []
        for i, rate in enumerate(tqdm(rates, desc="rates", unit="rate")):
            for speculation in ((True, False) if i % 2 == 0 else (False, True)):
                runs.append(asyncio.run(run_rate(url, prompts, rate, args.max_tokens, speculation, args.seed + i)))
        ttft_prompts = prompts[: args.ttft_prompts]
        through_http = http_ttft(url, ttft_prompts)
    finally:
        server.terminate()
        server.wait(timeout=60)
    offline_ttft(engine, ttft_prompts[:2])  # warm-up
    offline = offline_ttft(engine, ttft_prompts)
    overhead = {"http_ttft_ms": statistics.median(through_http) * 1000,
                "offline_ttft_ms": statistics.median(offline) * 1000}
    overhead["overhead_ms"] = overhead["http_ttft_ms"] - overhead["offline_ttft_ms"]

    rows = []
    for rate in rates:
        on, off = (next(r for r in runs if r["rate"] == rate and r["speculation"] == s) for s in (True, False))
        for r in (on, off):
            rows.append([f"{rate:g}", "on" if r["speculation"] else "off", f"{r['tok_s']:.1f}",
                         *(f"{r[k]['p50'] * 1000:.0f} / {r[k]['p90'] * 1000:.0f} / {r[k]['p99'] * 1000:.0f}"
                           for k in ("ttft", "tpot", "itl")),
                         f"{on['tok_s'] / off['tok_s']:.2f}x / {off['tpot']['p50'] / on['tpot']['p50']:.2f}x"
                         if r is on else ""])
    result = {"model": args.model, "draft": args.draft, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "requests_per_run": args.requests, "runs": runs, "ttft_overhead": overhead}
    caption = (f"Serving {args.model} ({args.dtype}, drafter `{args.draft}`, adaptive budgets) through HTTP: "
               f"{args.requests} streaming Spec-Bench completions of {args.max_tokens} tokens per rate and "
               f"setting, Poisson arrivals; latencies p50 / p90 / p99 in ms; on/off: generated tok/s with "
               f"speculation on over off (below saturation both follow the arrivals) / TPOT p50 off over on "
               f"(above 1: speculation makes each token come sooner). "
               f"TTFT of one request at a time: HTTP {overhead['http_ttft_ms']:.1f} ms "
               f"vs the offline engine {overhead['offline_ttft_ms']:.1f} ms (median of {len(offline)}): "
               f"{overhead['overhead_ms']:+.1f} ms.")
    write_report(args.out, result, caption, ["req/s", "speculation", "tok/s", "TTFT ms", "TPOT ms", "ITL ms",
                                             "on/off: tok/s / TPOT"], rows)
    plot(runs, Path(f"{args.out}.png"))


if __name__ == "__main__":
    main()
