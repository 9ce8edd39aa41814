"""`specserve ablate` runs a grid through the real engine, resumes after an interrupt, and
writes a report and plots whose numbers hang together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specserve.ablation import config as ablation_config
from specserve.ablation import runner
from specserve.ablation.config import DraftConfig, load_ablation
from specserve.ablation.report import output_agreement, summarize, write_report
from specserve.ablation.trees import TreeShapes, node_positions
from specserve.cli import main
from specserve.tree import TokenTree

SMOKE = Path(__file__).resolve().parents[3] / "configs" / "ablations" / "smoke.yaml"
SPEC_BENCH_52 = Path(__file__).resolve().parents[2] / "data" / "spec_bench_52.jsonl"


@pytest.fixture(autouse=True)
def spec_bench_file(tmp_path, monkeypatch):
    """The tests' 52 Spec-Bench questions (4 per category) in Spec-Bench's own format, where the
    configs look for Spec-Bench by default (the shared data directory need not exist in CI)."""
    path = tmp_path / "spec_bench_questions.jsonl"
    rows = [json.loads(line) for line in SPEC_BENCH_52.read_text().splitlines()]
    path.write_text("".join(json.dumps({"category": r["category"], "turns": [r["prompt"]]}) + "\n" for r in rows))
    monkeypatch.setattr(ablation_config, "SPEC_BENCH", path)
    return path


def smoke_config(tmp_path: Path, target: Path, **changes) -> Path:
    settings = {**yaml.safe_load(SMOKE.read_text()), "target": str(target), **changes}
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_the_grid_is_every_combination_after_the_baseline(tmp_path, tiny_chat_model):
    config = load_ablation(smoke_config(tmp_path, tiny_chat_model))
    names = [c.name for c in config.configurations]
    assert names == ["no-spec", "ngram b2 chain", "ngram b2 dynamic k4", "ngram b4 chain", "ngram b4 dynamic k4"]
    assert config.drafters == ["ngram"]
    assert DraftConfig("ngram", 4, "chain").speculation() == {"drafter": "ngram", "max_tree_tokens": 4,
                                                               "tree": "chain", "top_k": 4, "max_depth": None}


@pytest.mark.parametrize("change, message", [
    ({"grid": {"drafter": "none"}}, "must not name 'none'"),
    ({"grid": {"drafter": "ngram", "tree": "wide"}}, "grid tree 'wide'"),
    ({"grid": {"drafter": "ngram", "budget": 0}}, "budget and top_k must be integers >= 1"),
    ({"grid": {"drafter": "ngram", "width": 2}}, "unknown keys ['width']"),
    ({"concurrency": [0]}, "concurrency must be a list of integers >= 1"),
    ({"generation": {"max_tokens": 0}}, "generation:"),
    ({"prompts": {"spec_bench": {"categories": ["poetry"]}}}, "unknown ['poetry']"),
    ({"tree_report": "ngram b9 chain"}, "is not a configuration"),
    ({"colour": "red"}, "unknown keys ['colour']"),
    ({"engine": {"draft": "ngram"}}, "engine has unknown keys ['draft']"),
    ({"engine": {"speculation": "sometimes"}}, "engine: speculation 'sometimes'"),
])
def test_bad_configs_say_what_to_change(tmp_path, tiny_chat_model, change, message):
    with pytest.raises(ValueError) as error:
        config = load_ablation(smoke_config(tmp_path, tiny_chat_model, **change))
        config.load_prompts(tmp_path)
    assert message in str(error.value)


def test_a_smoke_ablation_reports_consistent_numbers_and_resumes(tmp_path, tiny_chat_model, monkeypatch):
    # 24 tokens: long enough for the tiny model's output to repeat itself, so n-gram lookup drafts.
    path = smoke_config(tmp_path, tiny_chat_model, tree_report="ngram b4 dynamic k4",
                        generation={"max_tokens": 24, "temperature": 0, "seed": 0, "ignore_eos": True})
    out = tmp_path / "out"
    config = load_ablation(path)

    # Interrupt the run after a few measurements: what was measured is kept.
    measure, calls = runner._measure, []

    def interrupted(*args):
        if len(calls) == 7:
            raise KeyboardInterrupt
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(runner, "_measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_ablation(config, out, progress=False)
    assert len(json.loads((out / "results.json").read_text())["measurements"]) == 7

    # Rerun through the CLI: it resumes, measuring only the rest.
    calls.clear()
    monkeypatch.setattr(runner, "_measure", lambda *args: (calls.append(1), measure(*args))[1])
    assert main(["ablate", str(path), "--out", str(out)]) == 0
    cells = len(runner.plan(config, 2))
    assert cells == 2 * 2 * 5 + 2 * 5 and len(calls) == cells - 7
    results = json.loads((out / "results.json").read_text())
    assert len({(m["config"], m["concurrency"], m["repeat"], m["prompt"]) for m in results["measurements"]}) == cells
    assert results["versions"]["torch"] and results["machine"]["threads"] >= 1

    # Every configuration gives the baseline's output (greedy), and the numbers hang together.
    outputs = {}
    for m in results["measurements"]:
        if m["prompt"] is not None:
            outputs.setdefault(m["prompt"], set()).add(tuple(m["output"]))
    assert all(len(o) == 1 for o in outputs.values())
    summary = summarize(results)
    # fp32: every configuration's output is the baseline's (2 prompts x 2 repeats)
    assert summary["agreement"] == {name: {"identical": 4, "of": 4, "prefix_share": 1.0}
                                    for name in summary["configs"] if name != "no-spec"}
    base = summary["per_category"]["no-spec"]
    assert all(row["speedup"] == pytest.approx(1.0) and row["mat"] is None for row in base.values())
    for name in ("ngram b2 chain", "ngram b4 dynamic k4"):
        row = summary["per_category"][name]["all"]
        assert row["mat"] >= 1 and row["speedup"] > 0
        assert all(a >= b for a, b in zip(row["acceptance_by_depth"], row["acceptance_by_depth"][1:], strict=False))
        assert 0 <= row["draft_share"] <= 1 and 0 < row["verify_share"] <= 1
    assert len(summary["per_category"]["ngram b2 chain"]["all"]["acceptance_by_depth"]) <= 2
    assert set(summary["throughput"]["no-spec"]) == {1, 2}

    report = (out / "report.md").read_text()
    assert "| writing |" in report and "| coding |" in report and "**" in report
    for plot in ("speedup_by_category", "acceptance_by_depth", "mat_vs_budget", "throughput_vs_concurrency"):
        assert (out / f"{plot}.png").stat().st_size > 1000 and f"({plot}.png)" in report
    assert write_report(out / "results.json") == out / "report.md"  # --report-only's path

    # The tree report counts every verifying step of its configuration, resumed or not.
    trees = results["trees"]
    measured = [m for m in results["measurements"] if m["config"] == "ngram b4 dynamic k4"]
    steps = sum(m["verify_steps"] for m in measured)
    assert trees["config"] == "ngram b4 dynamic k4" and trees["steps"] == steps > 0
    assert sum(s["count"] for s in trees["shapes"]) == steps
    assert all(s["accepted"][0] == s["count"] and len(s["parents"]) <= 5 for s in trees["shapes"])
    positions = {tuple(p["position"]): p for p in trees["positions"]}
    assert positions[()]["drafted"] == positions[()]["accepted"] == steps
    drafted = [p for p in positions if p]
    assert sum(positions[p]["drafted"] for p in drafted) == sum(m["drafted_tokens"] for m in measured)
    for depth in range(1, 5):
        accepted = sum(m["accepted_at_depth"][depth - 1] for m in measured if len(m["accepted_at_depth"]) >= depth)
        assert sum(positions[p]["accepted"] for p in drafted if len(p) == depth) == accepted
    assert all(positions[p]["accepted"] <= positions[p]["drafted"] <= positions[p[:-1]]["drafted"] for p in drafted)
    assert (out / "tree_shapes.png").stat().st_size > 1000


def test_a_changed_config_does_not_resume_into_old_results(tmp_path, tiny_chat_model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"fingerprint": "other", "measurements": []}))
    config = load_ablation(smoke_config(tmp_path, tiny_chat_model))
    with pytest.raises(ValueError, match="different config"):
        runner.Results(out / "results.json", config)


def test_output_agreement_counts_identical_replies_and_how_far_the_others_agree():
    def m(config, prompt, repeat, output):
        return {"config": config, "prompt": prompt, "repeat": repeat, "output": output}

    single = [m("no-spec", 0, 0, [1, 2, 3, 4]), m("no-spec", 1, 0, [5, 6]), m("no-spec", 0, 1, [1, 2, 3, 4]),
              m("a", 0, 0, [1, 2, 9, 9]), m("a", 1, 0, [5, 6]), m("a", 0, 1, [1, 2, 3, 4]),
              m("b", 0, 0, [7, 2, 3, 4])]
    agreement = output_agreement(single)
    assert agreement["a"] == {"identical": 2, "of": 3, "prefix_share": pytest.approx((0.5 + 1 + 1) / 3)}
    assert agreement["b"] == {"identical": 0, "of": 1, "prefix_share": 0.0}


def test_tree_positions_name_nodes_by_sibling_ranks_and_add_up_over_steps():
    tree = TokenTree((5, 6, 7, 8, 9, 10), (-1, 0, 0, 1, 2, 1))
    assert node_positions(tree) == [(), (0,), (1,), (0, 0), (1, 0), (0, 1)]
    shapes = TreeShapes()
    shapes.observe(tree, [0, 1, 5])
    shapes.observe(TokenTree.chain([5, 6, 7]), [0])
    saved = json.loads(json.dumps(shapes.to_json()))  # what results.json holds, resumed from
    resumed = TreeShapes(saved)
    resumed.observe(TokenTree.chain([5, 6]), [0, 1])
    counts = {tuple(p["position"]): (p["drafted"], p["accepted"]) for p in resumed.to_json()["positions"]}
    assert counts == {(): (3, 3), (0,): (3, 2), (1,): (1, 0), (0, 0): (2, 0), (1, 0): (1, 0), (0, 1): (1, 1)}
    assert resumed.steps == 3 and [s["count"] for s in resumed.most_common()] == [1, 1, 1]


@pytest.mark.parametrize("name", ["drafters", "tree-shape", "load", "qwen-pair", "smoke"])
def test_the_shipped_ablations_load(name):
    config = load_ablation(SMOKE.parent / f"{name}.yaml")
    assert config.name == name and len(config.configurations) >= 2
    assert config.load_prompts(SMOKE.parent)
