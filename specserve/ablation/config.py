"""An ablation's YAML file: the target, the prompts, how to generate, and a grid of draft
configurations, each run against the same engine's no-speculation baseline.

    name: drafters
    target: smollm2-135m-instruct
    dtype: bfloat16
    engine: {kv_cache_memory: 1GiB}            # more EngineConfig fields (speculation: fixed default)
    prompts:
      spec_bench: {categories: all, per_category: 3}   # or: file: prompts.jsonl, count: 20
    generation: {max_tokens: 128, temperature: 0, seed: 0, ignore_eos: true}
    concurrency: [1]
    repeats: 3
    grid:                                      # every combination is one configuration
      drafter: [ngram, feature, early-exit:trained]
      budget: [8, 16]                          # drafted nodes per request and step at most
      tree: [dynamic]                          # chain | tree | dynamic
      top_k: [4]
      depth: [null]                            # null: as deep as the budget
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specserve.sampling import TREE_SHAPES, SamplingParams

SPEC_BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench_questions.jsonl"
GRID_KEYS = ("drafter", "budget", "tree", "top_k", "depth")
BASELINE = "none"


@dataclass(frozen=True)
class DraftConfig:
    """One point of the grid: what a request asks of speculation (`SpeculationParams`)."""

    drafter: str
    budget: int = 8
    tree: str = "dynamic"
    top_k: int = 4
    depth: int | None = None

    @property
    def name(self) -> str:
        if self.drafter == BASELINE:
            return "no-spec"
        depth = "" if self.depth is None else f" d{self.depth}"
        shape = "chain" if self.tree == "chain" else f"{self.tree} k{self.top_k}"
        return f"{self.drafter} b{self.budget} {shape}{depth}"

    def speculation(self) -> dict[str, Any]:
        if self.drafter == BASELINE:
            return {"enabled": False}
        return {"drafter": self.drafter, "max_tree_tokens": self.budget, "tree": self.tree, "top_k": self.top_k,
                "max_depth": self.depth}


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str


@dataclass
class AblationConfig:
    name: str
    target: str
    prompts: dict[str, Any]
    grid: list[DraftConfig]
    dtype: str = "bfloat16"
    engine: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=lambda: {"max_tokens": 128, "temperature": 0.0, "seed": 0,
                                                                "ignore_eos": True})
    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3
    warmup: int = 1  # runs of each configuration on the first prompt before any is timed
    chat: bool = True  # prompts as one user turn in the target's chat template
    tree_report: str | None = None  # a configuration's name: draw its most common accepted trees

    @property
    def configurations(self) -> list[DraftConfig]:
        """The baseline first, then the grid."""
        return [DraftConfig(BASELINE), *self.grid]

    @property
    def drafters(self) -> list[str]:
        """Every drafter part the grid names: the engine loads them all at start-up."""
        return list(dict.fromkeys(p for c in self.grid for p in c.drafter.split("+")))

    def sampling(self, config: DraftConfig) -> SamplingParams:
        return SamplingParams(**self.generation, speculation=config.speculation())

    def fingerprint(self) -> str:
        """What the measurements depend on: a resumed run must have the same."""
        settings = asdict(self)
        settings.pop("tree_report")
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def load_prompts(self, base: Path) -> list[Prompt]:
        if "spec_bench" in self.prompts:
            options = self.prompts["spec_bench"] or {}
            path = Path(options.get("file", SPEC_BENCH))
            return spec_bench_prompts(path if path.is_absolute() else base / path, options.get("categories", "all"),
                                      int(options.get("per_category", 3)))
        path = Path(self.prompts["file"])
        return file_prompts(path if path.is_absolute() else base / path, self.prompts.get("count"))


def spec_bench_prompts(path: Path, categories: str | list[str], per_category: int) -> list[Prompt]:
    """The first turns of the first `per_category` Spec-Bench questions of each category, in
    round-robin order (so every prefix of the list covers the categories evenly)."""
    by_category = spec_bench_by_category(path)
    if categories != "all":
        unknown = sorted(set(categories) - set(by_category))
        if unknown:
            raise ValueError(f"prompts.spec_bench.categories: unknown {unknown}; Spec-Bench has "
                             f"{', '.join(by_category)}")
        by_category = {c: by_category[c] for c in categories}
    rounds = [[Prompt(qs[i], c) for c, qs in by_category.items() if i < len(qs)] for i in range(per_category)]
    return [p for r in rounds for p in r]


def spec_bench_by_category(path: Path) -> dict[str, list[str]]:
    """First turns of Spec-Bench's questions by category, in file order."""
    if not path.exists():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}: give the path to its question.jsonl "
                                "(an ablation's prompts.spec_bench.file, a benchmark's --questions)")
    by_category: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            by_category.setdefault(q["category"], []).append(q["turns"][0])
    return by_category


def file_prompts(path: Path, count: int | None) -> list[Prompt]:
    """A JSONL file, one prompt per line: {"prompt": ...} (or "text", or Spec-Bench's "turns"),
    with an optional "category"."""
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        text = record.get("prompt") or record.get("text") or (record.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: give the prompt as \"prompt\" (or \"text\", or \"turns\")")
        prompts.append(Prompt(text, str(record.get("category", "all"))))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:count] if count else prompts


def load_ablation(path: str | Path) -> AblationConfig:
    """Read and check an ablation file; errors name the key to change."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ablation config {path} not found (see configs/ablations/)")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    known = {"name", "target", "dtype", "engine", "prompts", "generation", "concurrency", "repeats", "warmup", "chat",
             "grid", "tree_report"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; use {', '.join(sorted(known))}")
    for key in ("target", "prompts", "grid"):
        if key not in raw:
            raise ValueError(f"{path}: '{key}' is required")
    prompts = raw["prompts"]
    if not isinstance(prompts, dict) or len({"spec_bench", "file"} & set(prompts)) != 1:
        raise ValueError(f"{path}: prompts needs exactly one of spec_bench: {{...}} or file: PATH")
    generation = {"max_tokens": 128, "temperature": 0.0, "seed": 0, "ignore_eos": True, **(raw.get("generation") or {})}
    try:
        SamplingParams(**generation)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: generation: {error}") from None
    _check_engine(raw.get("engine") or {}, path)
    concurrency = raw.get("concurrency", [1])
    concurrency = concurrency if isinstance(concurrency, list) else [concurrency]
    if not concurrency or not all(isinstance(c, int) and c >= 1 for c in concurrency):
        raise ValueError(f"{path}: concurrency must be a list of integers >= 1, got {concurrency!r}")
    repeats, warmup = raw.get("repeats", 3), raw.get("warmup", 1)
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"{path}: repeats >= 1 and warmup >= 0, please")
    config = AblationConfig(
        name=str(raw.get("name", path.stem)), target=str(raw["target"]), prompts=prompts,
        grid=expand_grid(raw["grid"], path), dtype=str(raw.get("dtype", "bfloat16")),
        engine=dict(raw.get("engine") or {}), generation=generation, concurrency=concurrency, repeats=repeats,
        warmup=warmup, chat=bool(raw.get("chat", True)), tree_report=raw.get("tree_report"))
    names = [c.name for c in config.configurations]
    if config.tree_report is not None and config.tree_report not in names:
        raise ValueError(f"{path}: tree_report {config.tree_report!r} is not a configuration; use one of {names[1:]}")
    return config


def _check_engine(engine: dict, path: Path) -> None:
    """`engine:` holds EngineConfig fields, except the drafter (the grid's drafters load)."""
    from dataclasses import fields

    from specserve.config import EngineConfig

    allowed = {f.name for f in fields(EngineConfig)} - {"draft"}
    unknown = sorted(set(engine) - allowed)
    if unknown:
        raise ValueError(f"{path}: engine has unknown keys {unknown} (the grid names the drafters); use "
                         f"{', '.join(sorted(allowed))}")
    try:
        EngineConfig(**engine)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: engine: {error}") from None


def expand_grid(grid: Any, path: Path) -> list[DraftConfig]:
    """Every combination of the grid's lists (a scalar is a list of one); a list of such grids
    is their union. Chains ignore top_k (one child), so their duplicates collapse."""
    from drafters.spec import parse_spec

    grids = grid if isinstance(grid, list) else [grid]
    configs: dict[DraftConfig, None] = {}
    for g in grids:
        if not isinstance(g, dict) or "drafter" not in g:
            raise ValueError(f"{path}: grid needs at least 'drafter: [...]'")
        unknown = sorted(set(g) - set(GRID_KEYS))
        if unknown:
            raise ValueError(f"{path}: grid has unknown keys {unknown}; use {', '.join(GRID_KEYS)}")
        axes = {k: v if isinstance(v, list) else [v] for k, v in g.items()}
        for values in itertools.product(*axes.values()):
            point = dict(zip(axes, values, strict=True))
            drafter = str(point["drafter"])
            if drafter == BASELINE:
                raise ValueError(f"{path}: the grid must not name '{BASELINE}': every ablation runs the "
                                 "no-speculation baseline itself")
            try:
                parse_spec(drafter)
            except ValueError as error:
                raise ValueError(f"{path}: grid drafter: {error}") from None
            tree = str(point.get("tree", "dynamic"))
            if tree not in TREE_SHAPES:
                raise ValueError(f"{path}: grid tree {tree!r}: use {', '.join(TREE_SHAPES)}")
            budget, top_k, depth = point.get("budget", 8), point.get("top_k", 4), point.get("depth")
            if not isinstance(budget, int) or budget < 1 or not isinstance(top_k, int) or top_k < 1 or (
                    depth is not None and (not isinstance(depth, int) or depth < 1)):
                raise ValueError(f"{path}: grid budget and top_k must be integers >= 1, depth null or >= 1")
            configs[DraftConfig(drafter, budget, tree, 1 if tree == "chain" else top_k, depth)] = None
    return list(configs)
