"""Running an ablation: one engine, every configuration through the real scheduler, every
measurement saved as it is taken (an interrupted run resumes where it stopped).

At concurrency 1 the configurations run prompt by prompt in turn (interleaved), so a machine
whose speed drifts slows all of them alike; each request is timed alone. At concurrency c > 1
every prompt is sent with c in flight at a time (a closed loop), per configuration, and the
aggregate throughput is recorded.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from specserve.ablation.config import AblationConfig, DraftConfig
from specserve.ablation.trees import TreeShapes
from specserve.closed_loop import run_to_completion
from specserve.machine import processor_name
from specserve.sequence import SpecStats


@dataclass
class Measurement:
    """One configuration on one prompt (concurrency 1) or on all prompts (concurrency > 1)."""

    config: str
    concurrency: int
    repeat: int
    prompt: int | None  # None: the whole prompt set at once
    category: str
    tokens: int
    seconds: float
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    accepted_at_depth: list[int]
    draft_s: float  # drafters proposing trees
    verify_s: float  # target forwards that verified trees + walking the trees
    output: list[int] = field(default_factory=list)  # concurrency 1: the generated tokens

    @property
    def key(self) -> tuple:
        return self.config, self.concurrency, self.repeat, self.prompt


class Results:
    """`results.json`: the config, the machine, the versions and every measurement so far."""

    def __init__(self, path: Path, config: AblationConfig):
        self.path, self.config = path, config
        self.measurements: list[Measurement] = []
        self.prompts: list[dict] = []
        self.trees = TreeShapes()  # of the configuration `config.tree_report` names
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") != config.fingerprint():
                raise ValueError(f"{path} holds a run of a different config (settings changed since): "
                                 "give another --out, or delete it to start over")
            self.measurements = [Measurement(**m) for m in saved["measurements"]]
            self.trees = TreeShapes(saved.get("trees"))
        self.done = {m.key for m in self.measurements}

    def add(self, measurement: Measurement) -> None:
        self.measurements.append(measurement)
        self.done.add(measurement.key)
        self.save()

    def save(self) -> None:
        import torch

        import specserve

        data = {
            "fingerprint": self.config.fingerprint(), "config": asdict(self.config),
            "machine": {"processor": processor_name(), "cpus": os.cpu_count(),
                        "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
            "versions": {"specserve": getattr(specserve, "__version__", "dev"), "torch": torch.__version__,
                         "python": platform.python_version()},
            "prompts": self.prompts, "measurements": [asdict(m) for m in self.measurements],
        }
        if self.config.tree_report is not None:
            data["trees"] = {"config": self.config.tree_report, **self.trees.to_json()}
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(self.path)  # atomic: an interrupt never leaves half a file


def plan(config: AblationConfig, prompts: int) -> list[tuple[DraftConfig, int, int, int | None]]:
    """Every cell of the run, in running order: (configuration, concurrency, repeat, prompt)."""
    cells = []
    for concurrency in config.concurrency:
        for repeat in range(config.repeats):
            if concurrency == 1:
                cells += [(c, 1, repeat, p) for p in range(prompts) for c in config.configurations]
            else:
                cells += [(c, concurrency, repeat, None) for c in config.configurations]
    return cells


def run_ablation(config: AblationConfig, out: Path, base: Path = Path("."), progress: bool = True) -> Results:
    """Run (or resume) `config`, writing `out/results.json` after every measurement."""
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.pull import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    results = Results(out / "results.json", config)
    prompts = config.load_prompts(base)
    options = {"speculation": "fixed", "enable_prefix_caching": False, **config.engine,
               "draft": "+".join(config.drafters)}
    engine = LLMEngine(resolve_model(config.target), config.dtype, EngineConfig(**options))
    token_ids = [engine.encode(p.text, chat=config.chat) for p in prompts]
    measuring: list[str] = []  # the configuration being measured (not warming up)

    def observe(request_id: str, tree, path: list[int]) -> None:
        if measuring and measuring[0] == config.tree_report:
            results.trees.observe(tree, path)

    engine.tree_observers.append(observe)
    results.prompts = [{"category": p.category, "prompt_tokens": len(t)} for p, t in zip(prompts, token_ids,
                                                                                         strict=True)]
    cells = plan(config, len(prompts))
    todo = [cell for cell in cells if (cell[0].name, cell[1], cell[2], cell[3]) not in results.done]
    if todo:
        for c in config.configurations:  # warm-up: every shape each configuration runs, once untimed
            for _ in range(config.warmup):
                run_to_completion(engine, [token_ids[0]], config.sampling(c), 1)
    with tqdm(total=len(cells), initial=len(cells) - len(todo), desc=f"ablation {config.name}", unit="run",
              disable=not progress) as bar:
        for draft, concurrency, repeat, prompt in todo:
            bar.set_postfix_str(f"{draft.name} c={concurrency}")
            chosen = token_ids if prompt is None else [token_ids[prompt]]
            measuring[:] = [draft.name]
            m = _measure(engine, chosen, config.sampling(draft), concurrency)
            measuring.clear()
            category = "all" if prompt is None else prompts[prompt].category
            results.add(Measurement(draft.name, concurrency, repeat, prompt, category, **m))
            bar.update()
    return results


def _measure(engine, prompts: list[list[int]], params, concurrency: int) -> dict:
    metrics = engine.metrics
    before = (metrics.draft_s, metrics.target_s + metrics.verify_s)
    outputs, _, seconds = run_to_completion(engine, prompts, params, concurrency)
    spec = SpecStats()
    for o in outputs:
        spec.add(o.metrics.spec)
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds,
            "verify_steps": spec.verify_steps, "drafted_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens, "accepted_at_depth": list(spec.accepted_at_depth),
            "draft_s": metrics.draft_s - before[0], "verify_s": metrics.target_s + metrics.verify_s - before[1],
            "output": list(outputs[0].outputs[0].token_ids) if len(outputs) == 1 else []}
