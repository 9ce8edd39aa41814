"""Soak: a running `specserve serve` under overload, bursts, abort storms and hostile inputs for
a set time, then the checks that say it held (not a CI test: minutes long, and it measures).

The server (a subprocess) serves the embedded model with `--max-queued-requests Q`. Phases:

1. overload: 4 x Q closed-loop clients (chat completions, streaming and not), and every 20 s a
   burst of 40 simultaneous requests; refused clients wait for Retry-After;
2. abort storm: `--dropped` streams, each dropped after 1-3 chunks;
3. hostile inputs: `--edge` requests with sampling values at and beyond the edges (subnormal
   top_p and temperature, penalties at their bounds and past them, huge seeds) and `--drafter`
   requests with drafter strings (spaces, cases, combinations, 100 KB strings, paths);
4. overload again until `--minutes` are up.

Throughout, a thread asks /health every 100 ms and the server's RSS is read every 5 s. At the
end, once idle: every status code, 5xx (none expected: nothing here can fail a request inside
the engine), admitted requests that did not finish, KV blocks still held, p99 /health latency,
RSS after the first minute against RSS at the end, and whether the server's log holds a
traceback.

    python benchmarks/soak.py [--minutes 10] [--max-queued-requests 16] [--dropped 3000]

Writes `results/soak.{json,md}` and `results/soak.png` (RSS and /health latency over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from engine import SPEC_BENCH, percentiles, spec_bench_questions  # benchmarks/engine.py
from report import write_report
from serving import add_server_arguments, free_port, start_server
from tqdm import tqdm

from specserve.machine import processor_name

RESULTS = Path(__file__).parent / "results"
EDGE_VALUES = [
    {"top_p": 5e-324}, {"top_p": 1e-46}, {"top_p": 1e-50}, {"top_p": 1e-8},
    {"temperature": 1e-320}, {"temperature": 1e-39}, {"temperature": 1e-6}, {"temperature": 2.0},
    {"repetition_penalty": 1e-320}, {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0},
    {"repetition_penalty": 1e300}, {"min_p": 1.0}, {"top_k": 1}, {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"seed": 2**64}, {"seed": -(2**63)}, {"seed": 2**64 - 1}, {"n": 4, "temperature": 1e-30},
]


def drafter_strings(rng: random.Random) -> str:
    return rng.choice([
        "ngram" + " " * rng.randrange(0, 5000), rng.choice(["NGRAM", "NGram", " ngram "]),
        "+".join(["ngram"] * rng.randrange(1, 40)), "x" * 100_000, "/etc/passwd", "early-exit:999", "none",
        "ngram+" + "".join(rng.choice("abc:+ ") for _ in range(rng.randrange(1, 300))),
    ])


class Tally:
    """What the clients saw: status codes, admitted requests and whether each finished."""

    def __init__(self) -> None:
        self.statuses: Counter = Counter()
        self.by_phase: dict[str, Counter] = {}
        self.unfinished: list[str] = []  # admitted, not dropped on purpose, yet no proper end
        self.dropped = 0

    def saw(self, phase: str, status: int) -> None:
        self.statuses[status] += 1
        self.by_phase.setdefault(phase, Counter())[status] += 1


async def completion(client: httpx.AsyncClient, tally: Tally, phase: str, body: dict,
                     drop_after: int | None = None) -> int:
    """One chat completion; streaming ones must end with [DONE] after a finish_reason, unless
    dropped on purpose after `drop_after` chunks. Returns the status."""
    if not body.get("stream"):
        response = await client.post("/v1/chat/completions", json=body)
        tally.saw(phase, response.status_code)
        if response.status_code == 200 and not all(c["finish_reason"] in ("stop", "length")
                                                    for c in response.json()["choices"]):
            tally.unfinished.append(response.text[:200])
        return response.status_code
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        tally.saw(phase, response.status_code)
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        chunks, finished, done = 0, False, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunks += 1
                payload = json.loads(line[6:])
                finished = finished or any(c.get("finish_reason") for c in payload.get("choices", []))
                if drop_after is not None and chunks >= drop_after:
                    tally.dropped += 1
                    return 200  # leaving the block closes the connection mid-stream
        if not (done and finished):
            tally.unfinished.append(f"stream ended without [DONE] after {chunks} chunks")
        return 200


async def overload(client: httpx.AsyncClient, tally: Tally, prompts: list[str], clients: int, until: float,
                   rng: random.Random) -> None:
    async def one_client() -> None:
        while time.monotonic() < until:
            body = {"model": "bench", "messages": [{"role": "user", "content": rng.choice(prompts)}],
                    "max_tokens": 32, "temperature": 0, "stream": rng.random() < 0.5}
            if await completion(client, tally, "overload", body) == 429:
                await asyncio.sleep(1.0)  # as Retry-After says

    async def bursts() -> None:
        while time.monotonic() + 20 < until:
            await asyncio.sleep(20)
            await asyncio.gather(*(completion(client, tally, "burst", {
                "model": "bench", "messages": [{"role": "user", "content": rng.choice(prompts)}],
                "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}) for i in range(40)))

    await asyncio.gather(bursts(), *(one_client() for _ in range(clients)))


async def in_flight(jobs, concurrency: int, total: int, desc: str) -> None:
    """`total` calls of `jobs(i)`, `concurrency` at a time."""
    bar, queue = tqdm(total=total, desc=desc, unit="req"), iter(range(total))

    async def worker() -> None:
        for i in queue:
            await jobs(i)
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()


async def soak(url: str, args: argparse.Namespace, prompts: list[str]) -> Tally:
    rng, tally = random.Random(args.seed), Tally()
    start = time.monotonic()
    end = start + args.minutes * 60
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        clients = 4 * args.max_queued_requests
        print(f"overload: {clients} clients for {0.25 * args.minutes:.1f} min")
        await overload(client, tally, prompts, clients, start + 0.25 * (end - start), rng)

        async def dropped(i: int) -> None:  # short prompts: a storm of many, not of long prefills
            body = {"model": "bench", "messages": [{"role": "user", "content": prompts[i % len(prompts)][:80]}],
                    "max_tokens": 200, "temperature": 0, "stream": True}
            while await completion(client, tally, "abort storm", body, drop_after=rng.randint(1, 3)) == 429:
                await asyncio.sleep(0.2)

        await in_flight(dropped, args.max_queued_requests, args.dropped, "abort storm")

        async def edge(i: int) -> None:
            values = rng.choice(EDGE_VALUES)
            body = {"model": "bench", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "max_tokens": 16, "stream": rng.random() < 0.3, **values}
            while await completion(client, tally, "sampling edges", body) == 429:
                await asyncio.sleep(0.2)

        await in_flight(edge, 8, args.edge, "sampling edges")

        async def drafter(i: int) -> None:
            body = {"model": "bench", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "max_tokens": 16, "temperature": 0, "speculation": {"drafter": drafter_strings(rng)}}
            while await completion(client, tally, "drafter strings", body) == 429:
                await asyncio.sleep(0.2)

        await in_flight(drafter, 8, args.drafter, "drafter strings")
        if time.monotonic() < end:
            print(f"overload until {args.minutes} min")
            await overload(client, tally, prompts, clients, end, rng)
    return tally


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"specserve:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class Watch(threading.Thread):
    """/health every 100 ms and the server's RSS every 5 s, from a thread of its own."""

    def __init__(self, url: str, pid: int):
        super().__init__(daemon=True)
        self.url, self.pid, self.stop = url, pid, threading.Event()
        self.health: list[tuple[float, float, int]] = []  # (time, seconds, status)
        self.rss: list[tuple[float, float]] = []  # (time, MiB)

    def run(self) -> None:
        start = last_rss = time.monotonic()
        self.rss.append((0.0, rss_mib(self.pid)))
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(0.1):
                sent = time.monotonic()
                status = client.get(f"{self.url}/health").status_code
                self.health.append((sent - start, time.monotonic() - sent, status))
                if sent - last_rss >= 5:
                    self.rss.append((sent - start, rss_mib(self.pid)))
                    last_rss = sent


def plot(watch: Watch, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, health) = plt.subplots(1, 2, figsize=(12, 3.8))
    rss.plot([t / 60 for t, _ in watch.rss], [m for _, m in watch.rss])
    rss.set(xlabel="minutes", ylabel="MiB", title="server RSS")
    health.plot([t / 60 for t, _, _ in watch.health], [s * 1000 for _, s, _ in watch.health], ",", alpha=0.5)
    health.set(xlabel="minutes", ylabel="ms", title="/health latency", yscale="log")
    for ax in (rss, health):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(parser, dtype="float32", kv_cache_memory="256MiB")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--dropped", type=int, default=3000, help="streams dropped after 1-3 chunks")
    parser.add_argument("--edge", type=int, default=500, help="requests with sampling values at the edges")
    parser.add_argument("--drafter", type=int, default=200, help="requests with odd drafter strings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "soak"))
    args = parser.parse_args()
    by_category = list(spec_bench_questions(SPEC_BENCH).values())
    prompts = [questions[i] for i in range(8) for questions in by_category if i < len(questions)]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        tally, watch, elapsed, kv_in_use, failures, exit_code, server_log = run(args, prompts, log)

    report(args, tally, watch, elapsed, kv_in_use, failures, exit_code, server_log)


def run(args: argparse.Namespace, prompts: list[str], log) -> tuple:
    """Start the server, soak it, wait until idle, stop it (SIGTERM): what was seen, and its log."""
    port = free_port()
    server = start_server(args, port, ["--max-queued-requests", str(args.max_queued_requests)], log=log)
    url = f"http://127.0.0.1:{port}"
    watch = Watch(url, server.pid)
    try:
        watch.start()
        began = time.monotonic()
        tally = asyncio.run(soak(url, args, prompts))
        elapsed = time.monotonic() - began
        idle = time.monotonic()
        while metric(url, "num_requests_running") or metric(url, "num_requests_waiting"):
            assert time.monotonic() - idle < 120, "the server did not become idle"
            time.sleep(0.5)
        time.sleep(6)  # one more RSS reading, idle
        watch.stop.set()
        watch.join()
        kv_in_use = metric(url, "kv_cache_usage_perc")
        failures = metric(url, "request_failure_total")
    finally:
        server.terminate()
        exit_code = server.wait(timeout=120)
    log.seek(0)
    return tally, watch, elapsed, kv_in_use, failures, exit_code, log.read()


def report(args: argparse.Namespace, tally: Tally, watch: Watch, elapsed: float, kv_in_use: float, failures: float,
           exit_code: int, server_log: str) -> None:
    after_first_minute = next((m for t, m in watch.rss if t >= 60), watch.rss[-1][1])
    at_end = watch.rss[-1][1]
    latencies = [s for _, s, _ in watch.health]
    result = {
        "cpu": processor_name(), "model": args.model, "dtype": args.dtype, "minutes": elapsed / 60,
        "max_queued_requests": args.max_queued_requests,
        "requests": sum(tally.statuses.values()), "statuses": dict(tally.statuses),
        "statuses_by_phase": {k: dict(v) for k, v in tally.by_phase.items()},
        "server_errors": sum(n for s, n in tally.statuses.items() if s >= 500),
        "engine_failed_requests": failures, "dropped_streams": tally.dropped,
        "admitted_unfinished": len(tally.unfinished), "unfinished_examples": tally.unfinished[:5],
        "kv_blocks_in_use_at_end": kv_in_use, "health_ms": {k: v * 1000 for k, v in percentiles(latencies).items()},
        "health_non_200": sum(1 for _, _, s in watch.health if s != 200),
        "rss_mib": {"start": watch.rss[0][1], "after_first_minute": after_first_minute, "end": at_end,
                    "max": max(m for _, m in watch.rss), "series": watch.rss},
        "server_exit_code": exit_code, "traceback_in_log": "Traceback" in server_log,
        "server_log_tail": server_log[-3000:],
    }
    rows = [
        ["requests sent", str(result["requests"])],
        ["status codes", ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))],
        ["5xx", str(result["server_errors"])],
        ["requests the engine failed alone (500s)", f"{failures:.0f}"],
        ["streams dropped on purpose", str(tally.dropped)],
        ["admitted requests that did not finish", str(len(tally.unfinished))],
        ["KV blocks in use once idle", f"{kv_in_use:.0%}"],
        ["/health p50 / p99 / max ms", f"{result['health_ms']['p50']:.1f} / {result['health_ms']['p99']:.1f} / "
                                       f"{max(latencies) * 1000:.1f}"],
        ["/health answers other than 200", str(result["health_non_200"])],
        ["RSS MiB: start / after 1 min / end (idle) / max",
         f"{watch.rss[0][1]:.0f} / {after_first_minute:.0f} / {at_end:.0f} / {result['rss_mib']['max']:.0f}"],
        ["RSS end vs after 1 min", f"{at_end / after_first_minute - 1:+.1%}"],
        ["server exit code after SIGTERM; traceback in its log", f"{exit_code}; {result['traceback_in_log']}"],
    ]
    for phase, statuses in tally.by_phase.items():
        rows.append([f"phase: {phase}", ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))])
    caption = (f"Soak of `specserve serve` ({args.model}, {args.dtype}, drafter `{args.draft}`, "
               f"--max-queued-requests {args.max_queued_requests}) for {elapsed / 60:.1f} min on {processor_name()}: "
               f"overload by {4 * args.max_queued_requests} clients with bursts of 40, {args.dropped} dropped "
               f"streams, {args.edge} sampling-edge and {args.drafter} drafter-string requests.")
    write_report(args.out, result, caption, ["what", "measured"], rows)
    plot(watch, Path(f"{args.out}.png"))


if __name__ == "__main__":
    main()
