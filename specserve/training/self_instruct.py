"""Training prompts the target writes itself (Magpie, Xu et al. 2024).

A chat model given only the opening of a user turn in its own template (the system turn, then
the user's header) goes on to write what a user would ask. A system turn naming a topic steers
it across writing, coding, math, reasoning, extraction, translation, summarization and questions,
and several sampling temperatures vary it further. What it writes is kept unless it is unfinished
(the turn never ended), too short, a near-duplicate of a kept prompt, or shares a 13-word run
with a Spec-Bench question (the evaluation set: never trained on). Every candidate and its verdict
is appended to a JSONL file at once, so an interrupted run resumes and a larger count extends it.

Multi-turn: after the target has answered its own first turns, the same opening placed after such
an exchange (`write_follow_ups`) has it write the user's next turn, which it then answers with the
whole conversation as context.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from specserve.training.budget import Budget

TOPICS: dict[str, str] = {
    "writing": "creative and professional writing: stories, poems, emails, essays, speeches and product copy",
    "coding": "programming: writing, explaining, fixing and reviewing code in Python, JavaScript, SQL, C++ and "
              "shell scripts",
    "math": "mathematics: arithmetic, algebra, geometry, probability, statistics and word problems",
    "reasoning": "logic puzzles, riddles, planning and questions that need careful step-by-step reasoning",
    "extraction": "pulling names, dates, amounts and other fields out of a text, a table or a record the user "
                  "pastes into the message",
    "translation": "translating sentences and short texts between English, French, German, Spanish, Chinese and "
                   "Japanese",
    "summarization": "summarizing articles, reports, meeting notes and conversations the user pastes into the "
                     "message",
    "questions": "factual questions on science, history, geography, health, law and everyday life",
}
TEMPERATURES = (0.8, 1.0, 1.2)
CONTAMINATION_WORDS = 13  # a prompt sharing a run of this many words with an evaluation question is dropped
SHINGLE_WORDS = 3
NEAR_DUPLICATE = 0.5  # Jaccard similarity of word 3-grams at which a prompt repeats a kept one
MIN_WORDS = 4
MAX_PROMPT_TOKENS = 160  # what the target may write for one user turn
MAX_CANDIDATES_PER_PROMPT = 20  # a target that keeps fewer than one in this many writes no useful prompts


@dataclass
class Candidate:
    """One user turn the target wrote, and whether it was kept (`why`: the reason it was not)."""

    index: int
    topic: str
    temperature: float
    text: str
    why: str = ""
    follows: int = -1  # a follow-up turn: the exchange it follows (see `write_follow_ups`); -1: a first turn


@dataclass(frozen=True)
class Exchange:
    """A first user turn the target wrote and its own answer: what a follow-up turn continues."""

    topic: str
    prompt: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def word_grams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def evaluation_grams(spec_bench: Path) -> set[tuple[str, ...]]:
    """Every 13-word run of every turn of the Spec-Bench questions (JSONL with `turns`)."""
    if not spec_bench.exists():
        raise FileNotFoundError(f"{spec_bench} not found: self-written prompts are checked against Spec-Bench's "
                                f"questions for shared 13-word runs; pass their JSONL with --spec-bench PATH")
    grams: set[tuple[str, ...]] = set()
    for line in spec_bench.read_text().splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                grams |= word_grams(turn, CONTAMINATION_WORDS)
    return grams


class NearDuplicates:
    """Kept texts' word 3-grams, indexed: is a new text too like one of them?"""

    def __init__(self) -> None:
        self._shingles: list[set[tuple[str, ...]]] = []
        self._holding: dict[tuple[str, ...], list[int]] = {}  # shingle -> kept texts that have it

    @staticmethod
    def shingles(text: str) -> set[tuple[str, ...]]:
        """Its word 3-grams (a text shorter than that: its words as one shingle)."""
        return word_grams(text, SHINGLE_WORDS) or {tuple(words(text))}

    def seen(self, text: str) -> bool:
        shingles = self.shingles(text)
        shared = Counter(k for s in shingles for k in self._holding.get(s, ()))
        return any(n / len(shingles | self._shingles[k]) >= NEAR_DUPLICATE for k, n in shared.items())

    def add(self, text: str) -> None:
        shingles = self.shingles(text)
        for s in shingles:
            self._holding.setdefault(s, []).append(len(self._shingles))
        self._shingles.append(shingles)


def pre_query(tokenizer, topic: str, conversation: Sequence[dict[str, str]] = ()) -> str:
    """The chat template's text up to where a user's message begins, after a system turn naming
    the topic and the `conversation` so far (a follow-up turn): cut at a marker put in the
    user's place."""
    marker = "\u0000MESSAGE\u0000"
    system = (f"You are a helpful AI assistant. Users come to you for {TOPICS[topic]}; they write what they "
              f"need in their own words.")
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, *conversation,
                                          {"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise ValueError("the chat template does not show the user's message as given: it cannot open a user turn")
    return text[: text.index(marker)]


def plan(index: int) -> tuple[str, float]:
    """Candidate `index`'s topic and temperature: topics in turn, each at every temperature in turn."""
    names = list(TOPICS)
    return names[index % len(names)], TEMPERATURES[index // len(names) % len(TEMPERATURES)]


def cache_name(target: str, seed: int) -> str:
    """The prompts' cache file for a target and seed, keyed by everything that makes them."""
    recipe = [target, seed, TOPICS, TEMPERATURES, MAX_PROMPT_TOKENS, MIN_WORDS, NEAR_DUPLICATE, CONTAMINATION_WORDS]
    return f"prompts-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]}.jsonl"


def follow_ups_cache_name(exchanges_key: str) -> str:
    """The follow-up turns' cache file, keyed by what made the exchanges they follow (the first
    turns' cache and the answers' settings) and by their own recipe."""
    recipe = [exchanges_key, TEMPERATURES, MAX_PROMPT_TOKENS, MIN_WORDS, NEAR_DUPLICATE, CONTAMINATION_WORDS]
    return f"follow-ups-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]}.jsonl"


def write_prompts(engine, count: int, cache_file: Path, spec_bench: Path, seed: int = 0,
                  max_in_flight: int = 128, progress: bool = True,
                  budget: Budget | None = None) -> tuple[list[Candidate], dict]:
    """`count` prompts the target wrote and that passed the filters, in order, and the counts of
    what was kept (by topic) and dropped (by reason). Stops (`BudgetSpent`, what was written
    saved) when `budget` runs out."""
    openings = {topic: engine.tokenizer.encode(pre_query(engine.tokenizer, topic), add_special_tokens=False)
                for topic in TOPICS}

    def recipe(index: int) -> tuple[list[int], Candidate]:
        topic, temperature = plan(index)
        return openings[topic], Candidate(index, topic, temperature, "")

    return _write(engine, count, recipe, cache_file, spec_bench, seed, "prompts", max_in_flight, progress, budget)


def write_follow_ups(engine, exchanges: Sequence[Exchange], count: int, cache_file: Path, spec_bench: Path,
                     seed: int = 0, max_in_flight: int = 128, progress: bool = True,
                     budget: Budget | None = None) -> tuple[list[Candidate], dict]:
    """`count` follow-up user turns the target wrote after `exchanges` (its own first turns and
    answers: the opening of the next user turn after them, under the first turn's system turn),
    filtered as `write_prompts`' are; candidate i follows exchange i mod len(exchanges), each
    round over them at the next temperature. A multi-turn conversation asks for what a single
    turn never shows: revising, extending or questioning the answer before."""
    if not exchanges:
        raise ValueError("follow-up turns need self-written first turns with answers: raise --self-instruct")
    openings: dict[int, list[int]] = {}

    def recipe(index: int) -> tuple[list[int], Candidate]:
        follows = index % len(exchanges)
        exchange = exchanges[follows]
        if follows not in openings:
            text = pre_query(engine.tokenizer, exchange.topic, exchange.messages())
            openings[follows] = engine.tokenizer.encode(text, add_special_tokens=False)
        temperature = TEMPERATURES[index // len(exchanges) % len(TEMPERATURES)]
        return openings[follows], Candidate(index, exchange.topic, temperature, "", follows=follows)

    return _write(engine, count, recipe, cache_file, spec_bench, seed, "follow-ups", max_in_flight, progress,
                  budget)


def _write(engine, count: int, recipe: Callable[[int], tuple[list[int], Candidate]], cache_file: Path,
           spec_bench: Path, seed: int, stage: str, max_in_flight: int, progress: bool,
           budget: Budget | None) -> tuple[list[Candidate], dict]:
    """What `write_prompts` and `write_follow_ups` share: candidate i opened by `recipe(i)` (the
    opening's tokens, and the candidate without its text), written, judged and cached in turn."""
    from specserve.closed_loop import ClosedLoop
    from specserve.sampling import SamplingParams

    budget = budget or Budget()
    candidates = _load(cache_file)
    loaded = len(candidates)  # this run checks the budget only once it has written beyond these
    forbidden = evaluation_grams(spec_bench)
    kept = NearDuplicates()
    for c in candidates:
        if not c.why:
            kept.add(c.text)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with cache_file.open("a") as sink, tqdm(total=count, initial=min(count, _kept(candidates)), desc=f"write {stage}",
                                            unit="prompt", disable=not progress) as bar:
        while _kept(candidates) < count:
            start = len(candidates)
            if start >= MAX_CANDIDATES_PER_PROMPT * count:
                dropped = Counter(c.why for c in candidates if c.why).most_common(3)
                raise RuntimeError(f"the target kept {_kept(candidates)} of {start} prompts it wrote (dropped: "
                                   f"{dropped}): it does not write usable user turns; train on --data instead")
            # More candidates than still needed: some are dropped (a few rounds at most).
            batch = [recipe(i) for i in range(start, start + max(16, 2 * (count - _kept(candidates))))]
            params = [SamplingParams(temperature=c.temperature, top_p=0.95, seed=seed * 1_000_003 + c.index,
                                     max_tokens=MAX_PROMPT_TOKENS) for _, c in batch]
            loop = ClosedLoop(engine, [opening for opening, _ in batch], lambda k, params=params: params[k],
                              concurrency=max_in_flight)
            written: dict[int, Candidate] = {}
            saved = 0  # batch[:saved] are in `candidates` and the cache file
            while not loop.done:
                loop.step()
                for out in loop.finished:
                    k = loop.number(out)
                    completion = out.outputs[0]
                    candidate = replace(batch[k][1], text=completion.text.strip())
                    candidate.why = _verdict(candidate.text, completion.finish_reason, forbidden, kept)
                    if not candidate.why:
                        kept.add(candidate.text)
                        bar.update()
                    written[k] = candidate
                loop.finished.clear()
                # Saved in index order as they come: a resumed run sees what an uninterrupted one
                # did, and a run stopped by the budget (or killed) keeps the unbroken run so far.
                while saved in written:
                    candidates.append(written[saved])
                    sink.write(json.dumps(asdict(written[saved])) + "\n")
                    saved += 1
                sink.flush()
                unsaved_kept = sum(not c.why for k, c in written.items() if k >= saved)
                if budget.spent or _kept(candidates) + unsaved_kept >= count:
                    loop.close()  # send no more; those in flight finish and are saved, none written in vain
            if _kept(candidates) < count and len(candidates) > loaded:
                budget.check(stage, f"{_kept(candidates)} of {count} written")
    chosen = [c for c in candidates if not c.why][:count]
    last = chosen[-1].index if chosen else -1
    considered = [c for c in candidates if c.index <= last]
    stats = {"prompts": len(chosen), "candidates": len(considered), "temperatures": list(TEMPERATURES),
             "topics": dict(Counter(c.topic for c in chosen)),
             "dropped": dict(Counter(c.why for c in considered if c.why))}
    return chosen, stats


def _verdict(text: str, finish_reason: str | None, forbidden: set, kept: NearDuplicates) -> str:
    """Why a written prompt is dropped ("": kept)."""
    if finish_reason == "length":
        return "unfinished"
    if len(words(text)) < MIN_WORDS:
        return "too short"
    if word_grams(text, CONTAMINATION_WORDS) & forbidden:
        return "shares 13 words with Spec-Bench"
    if kept.seen(text):
        return "near-duplicate"
    return ""


def _kept(candidates: Iterable[Candidate]) -> int:
    return sum(1 for c in candidates if not c.why)


def _load(cache_file: Path) -> list[Candidate]:
    if not cache_file.exists():
        return []
    candidates = [Candidate(**json.loads(line)) for line in cache_file.read_text().splitlines() if line.strip()]
    return _contiguous(candidates)


def _contiguous(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The run of candidates 0, 1, 2, ... (a write cut short mid-batch leaves the rest to redo)."""
    by_index = {c.index: c for c in candidates}
    run = []
    while len(run) in by_index:
        run.append(by_index[len(run)])
    return run
