"""Training data for drafter heads: the target's own answers, then its hidden states over them.

1. `generate`: the target answers instructions (GPTeacher; never the Spec-Bench evaluation
   questions) through specserve's engine, batched. Each finished answer is appended to a
   JSONL file at once, so an interrupted run resumes where it stopped.
2. `extract`: one prefill forward over every (prompt + answer) records, per token, the
   final-normed hidden state (what the LM head reads: the feature head's input and target,
   and the teacher's logits through the LM head) and, for an early-exit head after layer K,
   the residual stream entering layer K. `extract_saved` saves them in shards of examples as it
   goes, so that stage resumes too.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.llama import LlamaForCausalLM
from specserve.training.budget import Budget
from specserve.tree import TokenTree

DEFAULT_DATA = ("gpteacher_roleplay.json", "gpteacher_toolformer.json")
STATE_SHARD_EXAMPLES = 256  # answers whose states are saved together (what a stopped run redoes at most)


@dataclass(frozen=True)
class GenerationSettings:
    """What makes a set of generated answers (the resume key: change one, generate anew)."""

    samples: int = 1200  # instructions answered
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384  # longer prompts are skipped
    temperature: float = 0.0  # 0: greedy, the answers the served target gives
    seed: int = 0
    self_instruct: int = 0  # prompts the target writes itself, answered too (`specserve.training.self_instruct`)
    follow_ups: int = 0  # follow-up turns it writes after its answers to those, answered in the conversation

    def key(self, files: Sequence[Path], target: str) -> str:
        """Answers are cached per instruction of one shuffled order (and self-written prompts in
        the order written), so asking for more later extends the same caches: the counts are not
        part of the key."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("samples", "self_instruct", "follow_ups")}
        text = json.dumps([settings, [Path(f).name for f in files], target], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class Example:
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def load_instructions(files: Sequence[Path], samples: int, seed: int) -> list[str]:
    """User turns from GPTeacher-style JSON (instruction + optional input), shuffled by `seed`."""
    turns: list[str] = []
    for file in files:
        records = json.loads(Path(file).read_text())
        if not isinstance(records, list) or not all(isinstance(r, dict) and "instruction" in r for r in records):
            raise ValueError(f"{file}: expected a JSON list of objects with an 'instruction' (and optional 'input')")
        for r in records:
            extra = (r.get("input") or "").strip()
            turns.append(r["instruction"].strip() + (f"\n\n{extra}" if extra else ""))
    random.Random(seed).shuffle(turns)
    return turns[:samples]


Chat = str | list[dict[str, str]]  # a user turn, or a conversation ending in one


def generate(engine, instructions: Sequence[Chat], settings: GenerationSettings, cache_file: Path,
             max_in_flight: int = 128, progress: bool = True, budget: Budget | None = None) -> list[Example]:
    """The target's answers to `instructions` (chat template), resuming from `cache_file`; stops
    (`BudgetSpent`, the answers so far saved) when `budget` runs out. Prompts too long are left out."""
    return [e for e in answer(engine, instructions, settings, cache_file, max_in_flight, progress, budget)
            if e.output_ids]


def answer(engine, instructions: Sequence[Chat], settings: GenerationSettings, cache_file: Path,
           max_in_flight: int = 128, progress: bool = True, budget: Budget | None = None) -> list[Example]:
    """`generate`, one example per instruction in order (a prompt too long: no output tokens)."""
    budget = budget or Budget()
    from specserve.closed_loop import ClosedLoop
    from specserve.sampling import SamplingParams

    done: dict[int, Example] = {}
    if cache_file.exists():
        for line in cache_file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["index"]] = Example(record["prompt_ids"], record["output_ids"])
    todo = [i for i in range(len(instructions)) if i not in done]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                            seed=settings.seed)
    with cache_file.open("a") as sink, tqdm(total=len(instructions), initial=len(done), desc="generate answers",
                                            unit="answer", disable=not progress) as bar:

        def record(index: int, example: Example) -> None:
            done[index] = example
            sink.write(json.dumps({"index": index, **asdict(example)}) + "\n")
            sink.flush()
            bar.update()

        prompts = {index: engine.encode(turn, chat=True) if isinstance(turn := instructions[index], str)
                   else engine.encode_chat(turn) for index in todo}
        for index in todo:
            if len(prompts[index]) > settings.max_prompt_tokens:
                record(index, Example(prompts[index], []))  # skipped: recorded so a resume skips it too
        kept = [index for index in todo if index not in done]
        loop = ClosedLoop(engine, [prompts[index] for index in kept], params, concurrency=max_in_flight)
        while not loop.done:
            loop.step()
            for out in loop.finished:
                record(kept[loop.number(out)], Example(list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
            loop.finished.clear()
            if budget.spent:  # let the answers in flight finish: all are saved, none generated in vain
                loop.close()
        if len(done) < len(instructions):
            budget.check("answers", f"{len(done)} of {len(instructions)} answered")
    return [done[i] for i in range(len(instructions))]


@dataclass
class Features:
    """Every example's tokens and the target's hidden states, flat: example e owns rows
    `offsets[e]:offsets[e+1]`, its answer from row `offsets[e] + prompt_lens[e]`."""

    tokens: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [E + 1] int64
    prompt_lens: torch.Tensor  # [E] int64
    hidden: dict[int, torch.Tensor]  # layer boundary -> [N, hidden] (see `ForwardOutput.hidden`)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def save(self, path: Path) -> None:
        tensors = {"tokens": self.tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens}
        tensors.update({f"hidden.{k}": h.contiguous() for k, h in self.hidden.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))

    @classmethod
    def load(cls, path: Path) -> Features:
        tensors = load_file(str(path))
        hidden = {int(name.split(".")[1]): t for name, t in tensors.items() if name.startswith("hidden.")}
        return cls(tensors["tokens"], tensors["offsets"], tensors["prompt_lens"], hidden)

    @classmethod
    def join(cls, parts: Sequence[Features]) -> Features:
        """The examples of `parts`, in order, as one."""
        lengths = torch.cat([p.offsets.diff() for p in parts])
        return cls(
            tokens=torch.cat([p.tokens for p in parts]),
            offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            prompt_lens=torch.cat([p.prompt_lens for p in parts]),
            hidden={k: torch.cat([p.hidden[k] for p in parts]) for k in parts[0].hidden},
        )

    def split(self, validation: float, seed: int) -> tuple[list[int], list[int]]:
        """Example indices for training and validation (at least one each when there are two)."""
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        count = max(1, round(validation * len(order))) if len(order) > 1 else 0
        return order[count:], order[:count]


def extract_saved(model: LlamaForCausalLM, examples: Sequence[Example], hidden_at: Sequence[int], path: Path,
                  budget: Budget | None = None, shard: int | None = None, progress: bool = True) -> Features:
    """`extract` saved to `path`, through shards of `shard` examples (STATE_SHARD_EXAMPLES) kept
    beside it until all are done: a run stopped by `budget` (`BudgetSpent`) resumes at its first
    missing shard. Shards start at fixed examples, so a resumed run batches every forward as an
    uninterrupted one."""
    if path.exists():
        return Features.load(path)
    budget, shard = budget or Budget(), shard or STATE_SHARD_EXAMPLES
    shards = path.with_name(path.name + ".shards")
    parts: list[Features] = []
    extracted = 0  # shards this run: it checks the budget only once it has moved forward
    with tqdm(total=sum(len(e.token_ids) for e in examples), desc="target hidden states", unit="tok",
              disable=not progress) as bar:
        for start in range(0, len(examples), shard):
            part_file = shards / f"{start:08d}.safetensors"
            if part_file.exists():
                parts.append(Features.load(part_file))
                bar.update(sum(len(e.token_ids) for e in examples[start: start + shard]))
                continue
            if extracted:
                budget.check("states", f"{start} of {len(examples)} answers recorded")
            part = extract(model, examples[start: start + shard], hidden_at, bar=bar)
            part.save(part_file)
            parts.append(part)
            extracted += 1
    features = Features.join(parts)
    features.save(path)
    shutil.rmtree(shards)
    return features


@torch.inference_mode()
def extract(model: LlamaForCausalLM, examples: Sequence[Example], hidden_at: Sequence[int],
            tokens_per_forward: int = 2048, progress: bool = True, bar: tqdm | None = None) -> Features:
    """The target's hidden states over every example, several examples per prefill forward
    (progress on `bar` where given, else a bar of its own)."""
    block_size = 16
    budget = max(tokens_per_forward, max(len(e.token_ids) for e in examples))
    pool = -(-budget // block_size) + 64  # a forward's examples each waste under a block

    def blocks(e: Example) -> int:
        return -(-len(e.token_ids) // block_size)

    device = model.norm.weight.device
    runner = ModelRunner(model, KVCache.for_model(model.config, pool, block_size, model.dtype, device))
    rows: dict[int, list[torch.Tensor]] = {k: [] for k in hidden_at}
    batch: list[Example] = []

    def flush() -> None:
        requests, next_block = [], 0
        for e in batch:
            table = list(range(next_block, next_block + blocks(e)))
            requests.append(TreeRequest(TokenTree.chain(e.token_ids), 0, table, "none"))
            next_block += len(table)
        for out in runner.forward(requests, hidden_at=hidden_at):
            for k in hidden_at:
                state = out.hidden[k]  # kept on the host (a copy either way: the rows outlive the step)
                rows[k].append(state.clone() if state.device.type == "cpu" else state.cpu())
        batch.clear()

    with (tqdm(total=sum(len(e.token_ids) for e in examples), desc="target hidden states", unit="tok",
               disable=not progress) if bar is None else nullcontext(bar)) as bar:
        for e in examples:
            if batch and (sum(len(b.token_ids) for b in batch) + len(e.token_ids) > budget
                          or sum(blocks(b) for b in batch) + blocks(e) > pool):
                flush()
            batch.append(e)
            bar.update(len(e.token_ids))
        if batch:
            flush()
    lengths = torch.tensor([len(e.token_ids) for e in examples], dtype=torch.int64)
    return Features(
        tokens=torch.tensor([t for e in examples for t in e.token_ids], dtype=torch.int64),
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        prompt_lens=torch.tensor([len(e.prompt_ids) for e in examples], dtype=torch.int64),
        hidden={k: torch.cat(v) for k, v in rows.items()},
    )
