"""`specserve train-drafter`: self-distil a drafter head for a target on this machine.

    prompts   with --self-instruct N: the target writes N user prompts of its own across topics
              (Magpie; filtered, none sharing 13 words with Spec-Bench; resumable)
    answers   the target answers GPTeacher instructions and those prompts (greedy, batched, resumable);
              with --follow-ups M, it then writes M next user turns after its own exchanges and
              answers those in the conversation (multi-turn)
    states    one forward over every answer records the target's hidden states
    vocab     the draft vocabulary: the answers' most frequent tokens
    train     the head learns the target's next-token distribution over that vocabulary
              (cross-entropy to its softmax) and, for a feature head, its next feature
              (smooth L1), with noise on the input features as EAGLE trains for drafting on
              its own imperfect features; top-1 agreement with the target on held-out answers
              is reported every epoch
    save      head.json + head.safetensors, loaded by `feature:DIR` / `early-exit:DIR`

Every stage keeps its work under the target's training folder as it goes (prompts and answers line
by line, states in shards, training at each epoch), so `--budget-minutes` can stop a run between
units of saved work and the same command goes on from there (`specserve.training.budget`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafters.heads import HEAD_KINDS, HeadConfig, save_head, target_fingerprint
from specserve.ablation.config import SPEC_BENCH  # evaluation only: self-written prompts are checked against it
from specserve.models.loader import default_dtype
from specserve.training.budget import Budget, BudgetSpent
from specserve.training.data import (
    DEFAULT_DATA,
    Features,
    GenerationSettings,
    answer,
    extract_saved,
    generate,
    load_instructions,
)
from specserve.training.heads import TrainableHead
from specserve.training.self_instruct import (
    Exchange,
    cache_name,
    follow_ups_cache_name,
    write_follow_ups,
    write_prompts,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@dataclass(frozen=True)
class TrainSettings:
    kind: str = "feature"
    layer: int | None = None  # early-exit: K (default: a quarter of the target's layers)
    epochs: int = 4
    lr: float | None = None  # default: 1e-3 for a feature head (fresh), 3e-4 for early exit (from layer K)
    batch_tokens: int = 4096  # padded tokens per optimizer step
    draft_vocab: int = 8192  # tokens the head scores (the answers' most frequent)
    validation: float = 0.05  # share of answers held out
    noise: float = 0.1  # uniform noise on input features, relative to their RMS (feature head)
    regression: float = 1.0  # weight of the feature regression (feature head)
    # Feature head: passes of training-time test, each feeding the head the features it predicted
    # in the last, as drafting does at depths 2, 3, ... (`specserve.training.heads.unrolled_mask`).
    unroll: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"kind {self.kind!r}: use one of {', '.join(HEAD_KINDS)}")
        if (self.epochs < 1 or self.batch_tokens < 16 or self.draft_vocab < 2 or not 0 <= self.validation < 1
                or self.unroll < 1):
            raise ValueError("epochs >= 1, batch_tokens >= 16, draft_vocab >= 2, 0 <= validation < 1 and unroll >= 1, "
                             "please")


@dataclass
class EpochReport:
    epoch: int  # 0: before training
    train_loss: float | None  # None before training
    val_loss: float
    val_agreement: float  # top-1 of the head == the target's next token, on held-out answers
    seconds: float
    val_agreement_by_depth: list[float] = field(default_factory=list)  # feature head: its own features fed back


def default_data_files() -> list[Path]:
    return [SHARED_DATA / name for name in DEFAULT_DATA]


@dataclass
class TrainingData:
    """A target and the hidden states over its own answers: what every head trains on."""

    model: object  # LlamaForCausalLM
    model_dir: Path
    engine: object  # the engine that generated the answers (no speculation)
    features: Features
    layer: int  # early exit: K (the head reads the residual entering layer K)
    head_layer: int  # the layer boundary the head's input comes from
    files: list[Path]
    answers: int
    generate_seconds: float
    prompts: dict  # where the answered prompts came from: counts by source (and topic, for self-written ones)
    states_file: Path  # where the states are saved: what a training checkpoint is keyed by


def prepare_data(target: str, settings: TrainSettings, generation: GenerationSettings,
                 data: Sequence[Path] | None = None, dtype: str | None = None, work_dir: Path | None = None,
                 progress: bool = True, device: str = "auto", spec_bench: Path = SPEC_BENCH,
                 budget: Budget | None = None, quantization: str = "auto") -> TrainingData:
    """Generate (or reuse) the target's answers and extract (or reuse) its hidden states; each
    stage stops (`BudgetSpent`, its work so far saved) when `budget` runs out."""
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.pull import cache_dir, resolve_model

    started = time.perf_counter()
    files = [Path(f) for f in (data or default_data_files())]
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"training data {f} not found: pass --data with GPTeacher-style JSON files")
    model_dir = resolve_model(target)
    name = Path(model_dir).name
    work = work_dir or cache_dir() / "train" / name
    # The target as `serve` runs it with the same dtype and quantization (by default: as served),
    # so the head learns the answers and states it will draft for.
    engine = LLMEngine(model_dir, dtype, EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024,
                                                      speculation="off", quantization=quantization, device=device))
    model = engine.model
    served = f"{name}-{model.weight_format()}-{model.dtype}"  # every cache below is of the target as it ran
    layer = settings.layer if settings.layer is not None else model.config.num_layers // 4
    if settings.kind == "early-exit" and not 0 < layer < model.config.num_layers:
        raise ValueError(f"early-exit layer {layer}: the target has {model.config.num_layers} layers; use 1.."
                         f"{model.config.num_layers - 1}")
    head_layer = layer if settings.kind == "early-exit" else model.config.num_layers

    key = generation.key(files, served)
    instructions = load_instructions(files, generation.samples, generation.seed)
    examples = generate(engine, instructions, generation, work / f"answers-{key}.jsonl", progress=progress,
                        budget=budget)
    prompts: dict = {"gpteacher": len(instructions)}
    if generation.self_instruct:
        written_file = work / cache_name(served, generation.seed)
        written, prompts["self_instruct"] = write_prompts(engine, generation.self_instruct, written_file, spec_bench,
                                                          generation.seed, progress=progress, budget=budget)
        answers_file = work / f"answers-{key}-{written_file.stem}.jsonl"  # answers by index: to these prompts only
        answers = answer(engine, [c.text for c in written], generation, answers_file, progress=progress,
                         budget=budget)
        examples += [a for a in answers if a.output_ids]
        if generation.follow_ups:
            exchanges = [Exchange(c.topic, c.text, engine.tokenizer.decode(a.output_ids, skip_special_tokens=True))
                         for c, a in zip(written, answers, strict=True) if a.output_ids]
            # keyed by the exchanges too: candidate i follows exchange i mod their number
            follow_file = work / follow_ups_cache_name(f"{answers_file.stem}-{len(exchanges)}")
            follow_ups, prompts["follow_ups"] = write_follow_ups(
                engine, exchanges, generation.follow_ups, follow_file, spec_bench, generation.seed, progress=progress,
                budget=budget)
            conversations = [[*exchanges[c.follows].messages(), {"role": "user", "content": c.text}]
                             for c in follow_ups]
            examples += generate(engine, conversations, generation, work / f"answers-{key}-{follow_file.stem}.jsonl",
                                 progress=progress, budget=budget)
    elif generation.follow_ups:
        raise ValueError("--follow-ups continue the target's own first turns: give --self-instruct N too")
    if len(examples) < 2:
        raise ValueError(f"only {len(examples)} usable answers: raise --samples")
    generated = time.perf_counter()
    layers = sorted({head_layer, model.config.num_layers})
    counts = f"{generation.samples}-{generation.self_instruct}-{generation.follow_ups}-{len(examples)}"
    states_file = work / f"states-{key}-{counts}-{'-'.join(map(str, layers))}.safetensors"  # key: as it ran
    features = extract_saved(model, examples, layers, states_file, budget, progress=progress)
    return TrainingData(model, Path(model_dir), engine, features, layer, head_layer, files, len(examples),
                        generated - started, prompts, states_file)


def train_drafter(target: str, out: Path, settings: TrainSettings | None = None,
                  generation: GenerationSettings | None = None, data: Sequence[Path] | None = None,
                  dtype: str | None = None, work_dir: Path | None = None, progress: bool = True,
                  device: str = "auto", spec_bench: Path = SPEC_BENCH, budget: Budget | None = None,
                  quantization: str = "auto") -> HeadConfig:
    """Generate (or reuse) the data, train a head, save it to `out`; returns its config. When
    `budget` runs out first, stops with `BudgetSpent`, everything done so far saved: the same
    call goes on from there."""
    settings, generation = settings or TrainSettings(), generation or GenerationSettings()
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    prepared = prepare_data(target, settings, generation, data, dtype, work_dir, progress, device, spec_bench,
                            budget, quantization)
    model, features = prepared.model, prepared.features
    train_ids, val_ids = features.split(settings.validation, settings.seed)
    vocab_ids, coverage = draft_vocabulary(features, train_ids, settings.draft_vocab, model.config)
    head = TrainableHead(model, settings.kind, prepared.layer, vocab_ids).to(model.norm.weight.device)
    checkpoint = _checkpoint_file(prepared.states_file, settings)
    history = fit(head, features, train_ids, val_ids, settings, prepared.head_layer, model.config.num_layers,
                  progress, checkpoint, budget)
    seconds = time.perf_counter() - started
    config = HeadConfig(
        kind=settings.kind, target=prepared.model_dir.name, target_fingerprint=target_fingerprint(prepared.model_dir),
        layer=prepared.head_layer, vocab_size=len(vocab_ids),
        training={
            "settings": asdict(settings), "generation": asdict(generation),
            "data": [f.name for f in prepared.files], "prompts": prepared.prompts, "answers": prepared.answers,
            "train_tokens": int(sum(_answer_rows(features, i) for i in train_ids)),
            "draft_vocab_coverage": coverage, "epochs": [asdict(h) for h in history],
            "val_agreement": history[-1].val_agreement, "generate_seconds": round(prepared.generate_seconds, 1),
            "train_seconds": round(sum(h.seconds for h in history), 1), "wall_seconds": round(seconds, 1),
            "dtype": str(model.dtype), "weights": model.weight_format(),
        })
    save_head(Path(out), config, head.tensors())
    checkpoint.unlink(missing_ok=True)  # the head is saved: nothing left to resume
    return config


def _checkpoint_file(states_file: Path, settings: TrainSettings) -> Path:
    """Where training on these states with these settings keeps its progress."""
    recipe = json.dumps([states_file.name, asdict(settings)], sort_keys=True)
    return states_file.with_name(f"checkpoint-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}.pt")


def _answer_rows(features: Features, example: int) -> int:
    return int(features.offsets[example + 1] - features.offsets[example] - features.prompt_lens[example])


def draft_vocabulary(features: Features, examples: Sequence[int], size: int, config) -> tuple[torch.Tensor, float]:
    """The `size` tokens most frequent in the training answers, plus EOS/BOS; and the share of
    answer tokens they cover."""
    answers = torch.cat([features.tokens[features.offsets[e] + features.prompt_lens[e]: features.offsets[e + 1]]
                         for e in examples])
    counts = torch.bincount(answers, minlength=config.vocab_size)
    special = [t for t in (config.bos_token_id, *config.eos_token_ids) if t is not None]
    top = counts.topk(min(size, config.vocab_size)).indices
    ids = torch.cat([top, torch.tensor(special, dtype=torch.int64)]).unique()
    return ids, float(counts[ids].sum() / counts.sum())


def _batches(features: Features, examples: Sequence[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Examples of similar length together (little padding), up to `batch_tokens` padded tokens."""
    order = sorted(examples, key=lambda e: int(features.offsets[e + 1] - features.offsets[e]))
    batches, batch, longest = [], [], 0
    for e in order:
        length = int(features.offsets[e + 1] - features.offsets[e])
        if batch and max(longest, length) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(e)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


def _batch_tensors(features: Features, batch: list[int], input_layer: int, final_layer: int, kind: str):
    """Padded tokens, head inputs, target features and the loss mask of a batch."""
    lengths = [int(features.offsets[e + 1] - features.offsets[e]) for e in batch]
    width = max(lengths)
    hidden = features.hidden[final_layer].shape[1]
    tokens = torch.zeros(len(batch), width, dtype=torch.int64)
    inputs = torch.zeros(len(batch), width, hidden)
    target = torch.zeros(len(batch), width, hidden)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, (e, length) in enumerate(zip(batch, lengths, strict=True)):
        start = int(features.offsets[e])
        tokens[row, :length] = features.tokens[start: start + length]
        final = features.hidden[final_layer][start: start + length].float()
        target[row, :length] = final
        if kind == "feature":  # row i reads f_{i-1}; row 0 reads zeros
            inputs[row, 1:length] = final[:-1]
        else:
            inputs[row, :length] = features.hidden[input_layer][start: start + length].float()
        # Rows that guess an answer token: from the prompt's last row to the one before the end.
        mask[row, int(features.prompt_lens[e]) - 1: length - 1] = True
    next_tokens = torch.zeros_like(tokens)
    next_tokens[:, :-1] = tokens[:, 1:]
    return tokens, inputs, target, mask, next_tokens


def _loss(head: TrainableHead, batch, settings: TrainSettings, noise: bool,
          top_k: int = 1) -> tuple[torch.Tensor, list[int], int]:
    """The loss (mean over passes), the rows whose `top_k` guesses hold the target's next token
    per pass (pass d: drafting depth d), and the rows counted."""
    device = head.embed.device  # the batch is built on the host
    tokens, inputs, target, mask, next_tokens = (t.to(device) for t in batch)
    if noise and head.kind == "feature" and settings.noise > 0:
        scale = inputs.pow(2).mean().sqrt() * settings.noise
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * scale
    with torch.no_grad():
        teacher = F.softmax(head.teacher_logits(target[mask]), dim=-1)
        wanted = _vocab_index(head, next_tokens[mask])
    passes = settings.unroll if head.kind == "feature" else 1
    loss, agreed, past = torch.zeros((), device=device), [], []
    for _ in range(passes):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_fast_bf16(device)):
            logits, out, kv = head(tokens, inputs, past)
        past.append(kv)
        rows, states = logits[mask].float(), out[mask].float()
        loss = loss - (teacher * F.log_softmax(rows, dim=-1)).sum(-1).mean()
        if head.kind == "feature":
            loss = loss + settings.regression * F.smooth_l1_loss(states, target[mask])
        guesses = rows.topk(min(top_k, rows.shape[-1]), dim=-1).indices
        agreed.append(int((guesses == wanted[:, None]).any(-1).sum()))
        # The next pass: row i reads the feature row i - 1 predicted (a drafted node its parent's).
        inputs = F.pad(out[:, :-1].float(), (0, 0, 1, 0))
    return loss / passes, agreed, int(mask.sum())


def _fast_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast speeds training up there: on a GPU, or a CPU with native bf16. On a
    CPU without (AVX2 only) a bf16 step of the feature head took 34x an fp32 one (214 s vs 6.3 s)."""
    return device.type != "cpu" or default_dtype() == torch.bfloat16


def _vocab_index(head: TrainableHead, tokens: torch.Tensor) -> torch.Tensor:
    """Positions of tokens in the draft vocabulary (-1 for tokens outside it: never agreed with)."""
    lookup = torch.full((int(head.vocab_ids.max()) + 2,), -1, dtype=torch.int64, device=tokens.device)
    lookup[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=tokens.device)
    return lookup[tokens.clamp(max=len(lookup) - 1)]


def fit(head: TrainableHead, features: Features, train_ids: Sequence[int], val_ids: Sequence[int],
        settings: TrainSettings, input_layer: int, final_layer: int, progress: bool = True,
        checkpoint: Path | None = None, budget: Budget | None = None) -> list[EpochReport]:
    """Train `head`; the reports before training and after each epoch. With `checkpoint`, the
    training's whole state (weights, optimizer, schedule, random generators, reports) is saved
    there after every epoch and where `budget` stops it (`BudgetSpent`), and a call that finds it
    goes on from there: the head comes out as from one uninterrupted call."""
    budget = budget or Budget()
    rng = random.Random(settings.seed)
    lr = settings.lr or (1e-3 if head.kind == "feature" else 3e-4)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(_batches(features, train_ids, settings.batch_tokens, rng))
    total = steps_per_epoch * settings.epochs
    warmup = max(1, total // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    def report(epoch: int, train_loss: float | None, seconds: float) -> EpochReport:
        loss, by_depth = evaluate(head, features, val_ids, settings, input_layer, final_layer)
        return EpochReport(epoch, train_loss, loss, by_depth[0], round(seconds, 1), by_depth)

    def save(epoch: int, epoch_rng: tuple, step: int, losses: list[float], seconds: float) -> None:
        """Training stands before step `step` of epoch `epoch`, whose batches `epoch_rng` orders."""
        if checkpoint is None:
            return
        state = {"head": {n: p.detach().cpu() for n, p in head.named_parameters() if p.requires_grad},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "history": [asdict(h) for h in history], "epoch": epoch, "step": step, "losses": losses,
                 "seconds": seconds, "rng": epoch_rng, "torch_rng": _rng_states(head.embed.device)}
        partial = checkpoint.with_name(checkpoint.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, checkpoint)  # whole or not at all, should the run die while saving

    first_epoch, skip, losses, elapsed, stepped = 1, 0, [], 0.0, 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, map_location=head.embed.device)
        trained = dict(head.named_parameters())
        for name, value in state["head"].items():
            trained[name].data.copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history = [EpochReport(**h) for h in state["history"]]
        first_epoch, skip, losses, elapsed = state["epoch"], state["step"], state["losses"], state["seconds"]
        rng.setstate(state["rng"])
        _set_rng_states(state["torch_rng"], head.embed.device)
    else:
        history = [report(0, None, 0.0)]
    with tqdm(total=total, initial=(first_epoch - 1) * steps_per_epoch + skip, desc=f"train {head.kind} head",
              unit="step", disable=not progress) as bar:
        for epoch in range(first_epoch, settings.epochs + 1):
            epoch_rng, start = rng.getstate(), time.perf_counter() - elapsed
            head.train()
            for step, batch in enumerate(_batches(features, train_ids, settings.batch_tokens, rng)):
                if step < skip:
                    continue  # done before the run that saved the checkpoint stopped
                if stepped and budget.spent:  # this run has taken a step: it moved forward
                    save(epoch, epoch_rng, step, losses, time.perf_counter() - start)
                    raise BudgetSpent("train", f"epoch {epoch} of {settings.epochs}, step {step} of {steps_per_epoch}")
                loss, _, _ = _loss(head, _batch_tensors(features, batch, input_layer, final_layer, head.kind),
                                   settings, noise=True)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                stepped += 1
                bar.update()
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            history.append(report(epoch, sum(losses) / len(losses), time.perf_counter() - start))
            skip, losses, elapsed = 0, [], 0.0
            save(epoch + 1, rng.getstate(), 0, [], 0.0)
            depths = ", ".join(f"{a:.1%}" for a in history[-1].val_agreement_by_depth)
            bar.write(f"epoch {epoch}: train loss {history[-1].train_loss:.3f}, validation loss "
                      f"{history[-1].val_loss:.3f}, top-1 agreement with the target {depths} (by drafting depth)")
    return history


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's generators that training draws from (noise on the inputs): the CPU's, and the device's."""
    states = {"cpu": torch.random.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.random.set_rng_state(states["cpu"].cpu())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


@torch.no_grad()
def evaluate(head: TrainableHead, features: Features, examples: Sequence[int], settings: TrainSettings,
             input_layer: int, final_layer: int, top_k: int = 1) -> tuple[float, list[float]]:
    """Validation loss (per row) and top-`top_k` agreement with the target's next token (its
    share of rows with that token among the head's `top_k` guesses), per pass (drafting depth:
    depth d's rows read the features the head predicted d - 1 times over)."""
    head.eval()
    total_loss = rows = 0
    agreed: list[int] = []
    for batch in _batches(features, examples, settings.batch_tokens, random.Random(0)):
        loss, agree, count = _loss(head, _batch_tensors(features, batch, input_layer, final_layer, head.kind),
                                   settings, noise=False, top_k=top_k)
        total_loss += float(loss) * count
        agreed = [a + b for a, b in zip(agreed, agree, strict=True)] if agreed else agree
        rows += count
    return total_loss / max(rows, 1), [a / max(rows, 1) for a in agreed]
