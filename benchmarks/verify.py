"""What verifying a step's trees costs: the per-tree walk of an earlier commit against batched
verification (`specserve.verify.verify_batch`), in one run.

For 1, 16 and 64 sequences, each with a tree of 1, 8 or 32 nodes (a random recursive tree, or a
chain; along one root-to-leaf path each node's logits favour its child's token, so drafts are
often accepted), over SmolLM2's vocabulary (49,152), greedy, sampled (temperature 0.8) and
sampled with top-p 0.95: the time to turn the step's logits into each sequence's accepted path
and emitted tokens. "Before" is the engine's code at `--before` (checked out into a git
worktree and run in a process of its own: one `verify` per tree, a decode's row through argmax
or `sample_row`); "after" is this tree's. The two take turns, each after its own warm-up;
medians.

    python benchmarks/verify.py [--before 4ef4467] [--repeats 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from report import write_report
from tqdm import tqdm

RESULTS = Path(__file__).parent / "results"
VOCAB = 49152
SEQUENCES = (1, 16, 64)
NODES = (1, 8, 32)
MODES = ("greedy", "sampled", "top-p")
SHAPES = ("tree", "chain")


def step_inputs(sequences: int, nodes: int, shape: str, seed: int):
    """Trees, logits ([sequences * nodes, VOCAB]) and histories of one step. "tree": each node's
    parent any earlier node (a random recursive tree: bushy, a few levels deep); "chain": a
    drafted chain."""
    from specserve.tree import TokenTree

    gen = torch.Generator().manual_seed(seed)
    trees, rows = [], []
    for _ in range(sequences):
        parents = [-1] + [i - 1 if shape == "chain" else int(torch.randint(0, i, (), generator=gen))
                          for i in range(1, nodes)]
        tokens = torch.randint(0, VOCAB, (nodes,), generator=gen).tolist()
        tree = TokenTree(tuple(tokens), tuple(parents))
        logits = torch.randn(nodes, VOCAB, generator=gen) * 2
        node = 0
        while tree.children[node]:  # one path the target agrees with
            child = tree.children[node][int(torch.randint(0, len(tree.children[node]), (), generator=gen))]
            logits[node, tree.tokens[child]] += 12
            node = child
        trees.append(tree)
        rows.append(logits)
    history = torch.randint(0, VOCAB, (sequences, 64), generator=gen).tolist()
    return trees, torch.cat(rows), history


def params_of(mode: str):
    from specserve.sampling import SamplingParams

    return {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=0.8),
            "top-p": SamplingParams(temperature=0.8, top_p=0.95)}[mode]


def before_step(trees, logits, rows) -> list[list[int]]:
    """The engine's code at the commit under test: decode rows (1-node trees) stacked, greedy ones
    through one argmax, the others through `sample_row`; each tree through `verify`."""
    from specserve.sampling import sample_row
    from specserve.verify import verify

    out, plain, start = [], [], 0
    for tree, row in zip(trees, rows, strict=True):
        mine = logits[start:start + len(tree)]
        start += len(tree)
        if len(tree) == 1:
            plain.append((len(out), mine[-1], row))
            out.append([])
        else:
            out.append(verify(tree, mine, row).tokens)
    if plain:
        argmax = torch.stack([r for _, r, _ in plain]).argmax(-1).tolist()
        for (index, r, row), token in zip(plain, argmax, strict=True):
            out[index] = [token if row.params.plain_greedy else sample_row(r, row)]
    return out


def after_step(trees, logits, rows) -> list[list[int]]:
    from specserve.verify import Candidate, verify_batch

    return [v.tokens for v in verify_batch([Candidate(t, r) for t, r in zip(trees, rows, strict=True)], logits)]


def measure(side: str, repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per step for every shape, on this process's code."""
    from specserve.sampling import SamplingRow

    run = before_step if side == "before" else after_step
    times = {}
    shapes = [(shape, nodes) for shape in SHAPES for nodes in NODES if nodes > 1 or shape == SHAPES[0]]
    for mode in MODES:
        for sequences in SEQUENCES:
            for shape, nodes in shapes:
                trees, logits, history = step_inputs(sequences, nodes, shape, seed=sequences * 100 + nodes)
                rows = [SamplingRow(params_of(mode), h[:32], h[32:], torch.Generator().manual_seed(i))
                        for i, h in enumerate(history)]
                for _ in range(warmup):
                    run(trees, logits, rows)
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run(trees, logits, rows)
                    samples.append(time.perf_counter() - start)
                times[f"{mode}/{shape}/{sequences}/{nodes}"] = statistics.median(samples)
    return times


def worktree(rev: str) -> Path:
    """The commit `rev` checked out beside the repository (made once)."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=root, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specserve-verify-{sha}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=root, check=True,
                       capture_output=True)
    return path


def in_process_of(path: Path, side: str, repeats: int, warmup: int) -> dict[str, float]:
    """`measure` in a fresh process whose `specserve` is the one at `path`."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    result = subprocess.run([sys.executable, __file__, "--side", side, "--repeats", str(repeats), "--warmup",
                             str(warmup)], env=env, cwd=path, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="4ef4467", help="the commit whose per-tree verification to time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="turns of before and after")
    parser.add_argument("--side", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "verify"))
    args = parser.parse_args()
    if args.side:  # a turn in a process of its own
        print(json.dumps(measure(args.side, args.repeats, args.warmup)))
        return

    from specserve.machine import processor_name

    here = Path(__file__).resolve().parents[1]
    sides = {"before": worktree(args.before), "after": here}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for side, path in sides.items():
            for shape, seconds in in_process_of(path, side, args.repeats, args.warmup).items():
                samples[side].setdefault(shape, []).append(seconds)
    rows, table = [], []
    for shape in samples["after"]:
        mode, form, sequences, nodes = shape.split("/")
        before, after = (statistics.median(samples[side][shape]) * 1e3 for side in sides)
        rows.append({"mode": mode, "shape": form, "sequences": int(sequences), "nodes": int(nodes),
                     "before_ms": before,
                     "after_ms": after, "speedup": before / after})
        table.append([mode, form if int(nodes) > 1 else "-", sequences, nodes, f"{before:.2f}", f"{after:.2f}",
                      f"{before / after:.2f}x"])
    result = {"benchmark": "verify", "before": args.before, "vocab": VOCAB, "repeats": args.repeats,
              "rounds": args.rounds, "threads": torch.get_num_threads(), "machine": processor_name(),
              "torch": torch.__version__, "rows": rows}
    write_report(args.out, result,
                 f"Verification time per step (ms): the per-tree code at {args.before} against `verify_batch`, "
                 f"SmolLM2's vocabulary, {processor_name()}, {torch.get_num_threads()} threads; median over "
                 f"{args.rounds} turns of the median of {args.repeats} steps",
                 ["mode", "shape", "sequences", "nodes", "before ms", "after ms", "speed-up"], table)


if __name__ == "__main__":
    main()
