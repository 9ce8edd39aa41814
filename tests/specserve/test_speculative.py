"""Speculative decoding inside the continuous batcher is lossless.

Greedy: the same tokens as without speculation, prompt by prompt, for Spec-Bench questions of
all 13 categories run as one batch (4 per category for n-gram lookup, 1 for the model
drafters, whose drafting is dearer) and under preemption (1 per category). Sampling: the same
distribution (chi-square over 20,000 draws), and a broken verifier is caught by the same test.
Stops, max_tokens and EOS that fall inside an accepted run cut it exactly there; per-request
settings are honoured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafters import Drafter
from drafters.base import Observes
from specserve import verify as verify_module
from specserve.closed_loop import run_to_completion
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import processor_name
from specserve.sampling import SamplingParams

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "spec_bench_52.jsonl"


def make_engine(path, **options) -> LLMEngine:
    """fp32; every drafted tree at its cap (`speculation="fixed"`) unless a test says otherwise."""
    return LLMEngine(path, dtype="float32", config=EngineConfig(**{"speculation": "fixed", **options}))


def run_batch(engine: LLMEngine, prompts: list[list[int]], params, check: bool = True) -> list:
    """All prompts submitted at once; outputs in prompt order; invariants checked every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), ids, p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if check:
                engine.check_invariants()
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# -- greedy on the real SmolLM2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_bench(smollm2_path):
    """52 chat-formatted Spec-Bench questions (4 per category) and their non-speculative greedy output."""
    engine = make_engine(smollm2_path, kv_cache_memory="256MiB")
    questions = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()]
    prompts = [engine.encode(q["prompt"], chat=True) for q in questions]
    reference = tokens_of(run_batch(engine, prompts, SamplingParams(temperature=0, max_tokens=32)))
    return prompts, reference, [q["category"] for q in questions]


DRAFTERS = {  # every kind of drafter, and a merge of two (model drafters grow small trees here: speed;
    # the draft model scores only its first 16k token ids, with int8 projections: neither may matter)
    "ngram": dict(draft="ngram"),
    "suffix": dict(draft="suffix"),
    "draft-model": dict(draft="{draft}", draft_top_k=2, draft_beam=2, max_tree_tokens=6, draft_vocab=16384,
                        draft_quantization="int8"),
    "early-exit": dict(draft="early-exit:10", draft_top_k=2, draft_beam=2, max_tree_tokens=6),
    "merged": dict(draft="ngram+early-exit:10", draft_top_k=2, draft_beam=2, max_tree_tokens=6),
    "merged-lookups": dict(draft="ngram+suffix"),
    # the heads shipped for SmolLM2 (drafters/trained/), trained on its bf16 states: served here in fp32
    "feature-head": dict(draft="feature", draft_top_k=2, draft_beam=2, max_tree_tokens=6),
    "early-exit-head": dict(draft="early-exit:trained", draft_top_k=2, draft_beam=2, max_tree_tokens=6),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one-batch", "preemption"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculation_equals_plain_decoding(smollm2_path, smollm2_draft_path, spec_bench, drafter, case):
    prompts, reference, categories = spec_bench
    # CI time: model drafters run fp32 SmolLM2 layers and its LM head every round, and preemption
    # recomputes prompts, so those cases run one question per category (all 13 still covered).
    per_category = 4 if (drafter, case) == ("ngram", "one-batch") else 1
    chosen = [i for i, c in enumerate(categories) if categories[:i].count(c) < per_category]
    prompts, reference = [prompts[i] for i in chosen], [reference[i] for i in chosen]
    assert len({categories[i] for i in chosen}) == 13 and len(prompts) == 13 * per_category
    options: dict = {**DRAFTERS[drafter], "kv_cache_memory": "256MiB"}
    options["draft"] = options["draft"].format(draft=smollm2_draft_path)
    if case == "preemption":  # room for the longest sequence and a little more
        engine = make_engine(smollm2_path, **{**options, "kv_cache_memory": "4MiB"})
        longest = max(len(p) for p in prompts) + 32
        options["kv_cache_memory"] = engine.kv_bytes_per_block * (longest // 16 + 12)  # a drafter's K/V too
        options["schedule_conservativeness"] = 0  # admitted as vLLM admits, so that the pool runs out mid-reply
    engine = make_engine(smollm2_path, **options)
    outputs = run_batch(engine, prompts, SamplingParams(temperature=0, max_tokens=32))
    for i, (got, want) in enumerate(zip(tokens_of(outputs), reference, strict=True)):
        assert got == want, f"prompt {i}: speculative output differs"
    assert engine.metrics.spec.accepted_tokens > 0, "some drafted tokens should have been accepted"
    if case == "preemption":
        assert sum(o.metrics.num_preemptions for o in outputs) > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["merged-lookups", "feature-head"])
def test_greedy_speculation_over_an_int8_kv_cache_equals_plain_decoding_over_it(smollm2_path, spec_bench, drafter):
    """Lossless against the model as served: with an int8 KV cache, speculation gives plain
    decoding's tokens over the same int8 cache (a head keeps its own K/V in the model's dtype)."""
    prompts, _, categories = spec_bench
    chosen = [prompts[i] for i, c in enumerate(categories) if c not in categories[:i]]  # one per category
    greedy = SamplingParams(temperature=0, max_tokens=32)
    plain_engine = make_engine(smollm2_path, kv_cache_memory="64MiB", kv_cache_dtype="int8", speculation="off")
    assert plain_engine.kv_cache.k.dtype == torch.int8
    plain = tokens_of(run_batch(plain_engine, chosen, greedy))
    engine = make_engine(smollm2_path, **{**DRAFTERS[drafter], "kv_cache_memory": "64MiB", "kv_cache_dtype": "int8"})
    assert tokens_of(run_batch(engine, chosen, greedy)) == plain
    assert engine.metrics.spec.accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def row_variant_projection(model: torch.nn.Module, step_sizes) -> str | None:
    """A projection of `model` whose output row depends on the other rows of the step (oneDNN picks
    its blocking by the number of rows, and on some CPUs, e.g. AMD EPYC with AVX512-BF16, that
    changes the accumulation order), described; None when every row is computed alike."""
    from specserve.models.linear import Projection

    generator = torch.Generator().manual_seed(0)
    seen = set()
    for name, projection in model.named_modules():
        if not isinstance(projection, Projection) or (projection.in_features, *projection.out_sizes) in seen:
            continue
        seen.add((projection.in_features, *projection.out_sizes))
        for rows in step_sizes:
            x = torch.randn(rows, projection.in_features, generator=generator).to(model.dtype)
            together = projection(x)
            if any(not torch.equal(projection(x[r : r + 1])[0], together[r]) for r in range(rows)):
                return f"{name} ({projection.in_features} -> {sum(projection.out_sizes)}) in a step of {rows} rows"
    return None


@pytest.mark.slow
def test_greedy_chain_speculation_equals_plain_decoding_in_bf16_too(smollm2_path, spec_bench):
    """In bf16 a verifying chain's logits match one-token decodes' bit for bit (attention computes
    each row alone, in fp32, through the C++ kernel), so greedy chain speculation is exact there
    too, wherever the CPU's bf16 matmuls compute a row alike in steps of any size."""
    prompts, _, categories = spec_bench
    chosen = [prompts[i] for i, c in enumerate(categories) if c not in categories[:i]]  # one per category
    engine = LLMEngine(smollm2_path, dtype="bfloat16",
                       config=EngineConfig(speculation="fixed", draft="ngram+feature", kv_cache_memory="256MiB",
                                         enable_prefix_caching=False, quantization="none"))
    variant = row_variant_projection(engine.model, step_sizes=range(2, 10))
    if variant is not None:
        pytest.skip(f"this CPU's bf16 matmul ({processor_name()}) rounds a row of {variant} differently than "
                    f"the same row alone, so no chain can match one-token decodes bit for bit here")

    def replies(speculation: dict) -> list[list[int]]:  # greedy, each prompt alone
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculation=speculation)
        return [list(o.outputs[0].token_ids) for o in run_to_completion(engine, chosen, params, concurrency=1)[0]]

    plain = replies({"enabled": False})
    for drafter in ("ngram", "feature"):
        assert replies({"drafter": drafter, "tree": "chain"}) == plain, f"{drafter}: bf16 chain output differs"
    assert engine.metrics.spec.accepted_tokens > 0


# -- sampling on a tiny random model with a small vocabulary -------------------------------------

VOCAB = 8
# Repeats "5 1 x": the n-gram drafter proposes several continuations after "5 1" (a branching tree).
PATTERN_PROMPT = [5, 1, 2, 5, 1, 3, 5, 1, 4, 6, 5, 1]


def de_bruijn_pairs(k: int) -> list[int]:
    """A sequence holding every pair of k symbols once: whatever token comes next, the n-gram
    drafter finds it followed by several different tokens, so its trees branch at the root."""
    sequence, seen = [0], set()
    while len(seen) < k * k:
        last = sequence[-1]
        nxt = next((b for b in reversed(range(k)) if (last, b) not in seen), None)
        if nxt is None:
            break
        seen.add((last, nxt))
        sequence.append(nxt)
    return sequence


BRANCHING_PROMPT = de_bruijn_pairs(VOCAB)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, smollm2_path, make_tiny_checkpoint):
    """A tiny random Llama over 8 tokens (peaked logits), with a tokenizer the engine can load."""
    import shutil

    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("vocab8"), vocab_size=VOCAB, initializer_range=0.3,
                                     eos_token_id=7, bos_token_id=0)
    shutil.copy(smollm2_path / "tokenizer.json", directory / "tokenizer.json")
    shutil.copy(smollm2_path / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


class RecordingDrafter(Drafter, Observes):
    """Wraps a drafter and remembers the widest tree it proposed."""

    def __init__(self, inner: Drafter):
        self.inner, self.spec, self.max_children, self.sampled_nodes = inner, inner.spec, 0, 0

    def propose(self, requests):
        drafts = self.inner.propose(requests)
        for draft in drafts:
            self.max_children = max(self.max_children, *(len(c) for c in draft.tree.children))
            self.sampled_nodes += len(draft.probs)
        return drafts

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)

    def hidden_wanted(self):
        return self.inner.hidden_wanted() if isinstance(self.inner, Observes) else ()

    def observe(self, commit) -> None:
        if isinstance(self.inner, Observes):
            self.inner.observe(commit)

    def ended(self, ended) -> None:
        if isinstance(self.inner, Observes):
            self.inner.ended(ended)


def first_three(path, draft: str, params: SamplingParams, draws: int, **options) -> tuple[torch.Tensor, LLMEngine]:
    """Counts of the first three generated tokens over `draws` seeded requests (each generates
    four, so the trees verified after the first token have room to branch or go deep)."""
    engine = make_engine(path, draft=draft, max_num_seqs=256, max_num_batched_tokens=1024, kv_cache_memory="64MiB",
                         **options)
    if engine.drafter is not None:
        engine.drafter = RecordingDrafter(engine.drafter)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    batch = 2000
    for first in range(0, draws, batch):
        seeded = [SamplingParams(**{**vars(params), "seed": first + i, "speculation": None})
                  for i in range(min(batch, draws - first))]
        for out in run_batch(engine, [BRANCHING_PROMPT] * len(seeded), seeded, check=False):
            counts[tuple(out.outputs[0].token_ids[:3])] += 1
    return counts, engine


SAMPLING = {
    "T=1": SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    "top_p=0.8": SamplingParams(temperature=1.0, top_p=0.8, max_tokens=4, ignore_eos=True),
}
_plain_counts: dict[str, torch.Tensor] = {}


def plain_counts(path, case: str) -> torch.Tensor:
    """Without speculation (computed once per case for the tests that compare against it)."""
    if case not in _plain_counts:
        _plain_counts[case] = first_three(path, "none", SAMPLING[case], 20_000)[0]
    return _plain_counts[case]


@pytest.mark.parametrize(("drafter", "case"), [("ngram", "T=1"), ("ngram", "top_p=0.8"), ("suffix", "T=1"),
                                              ("ngram+suffix", "T=1")])
def test_sampled_speculation_has_the_same_distribution(small_vocab_model, drafter, case, chi_square_two_sample):
    speculative, engine = first_three(small_vocab_model, drafter, SAMPLING[case], 20_000)
    spec = engine.metrics.spec
    assert spec.verify_steps > 1000 and spec.accepted_tokens > 0
    if case == "T=1":
        assert len(spec.accepted_at_depth) > 1, "some steps accept a run of two drafted tokens"
    assert engine.drafter.max_children >= 2, "the verified trees branch"
    p_value = chi_square_two_sample(plain_counts(small_vocab_model, case), speculative)
    assert p_value > 0.01, f"{case}: speculative sampling changed the distribution (p = {p_value:.2e})"


@pytest.fixture(scope="module")
def small_vocab_draft(tmp_path_factory, small_vocab_model, make_tiny_checkpoint):
    """Another random model over the same 8 tokens: a draft that is often wrong."""
    import shutil

    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("vocab8-draft"), seed=1, vocab_size=VOCAB,
                                     initializer_range=0.3, eos_token_id=7, bos_token_id=0, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(small_vocab_model / name, directory / name)
    return directory


def test_sampled_draft_model_trees_keep_the_distribution(small_vocab_model, small_vocab_draft, chi_square_two_sample):
    """Draft-model children sampled from q without replacement, verified against q: half the
    draws from chains (runs of sampled tokens accepted in a row), half from branching trees.
    Each half is lossless, so together they must match plain sampling too."""
    chains, chain_engine = first_three(small_vocab_model, str(small_vocab_draft), SAMPLING["T=1"], 10_000,
                                       draft_top_k=1, draft_beam=1)
    trees, tree_engine = first_three(small_vocab_model, str(small_vocab_draft), SAMPLING["T=1"], 10_000,
                                     draft_top_k=2, draft_beam=2)
    assert len(chain_engine.metrics.spec.accepted_at_depth) > 1, "some steps accept two sampled tokens in a row"
    assert tree_engine.drafter.max_children >= 2 and tree_engine.metrics.spec.accepted_tokens > 0
    assert chain_engine.drafter.sampled_nodes > 1000 and tree_engine.drafter.sampled_nodes > 1000
    p_value = chi_square_two_sample(plain_counts(small_vocab_model, "T=1"), chains + trees)
    assert p_value > 0.01, f"draft-model speculation changed the distribution (p = {p_value:.2e})"


def test_a_verifier_that_always_accepts_is_caught(small_vocab_model, chi_square_two_sample, monkeypatch):
    plain = plain_counts(small_vocab_model, "T=1")
    params = SAMPLING["T=1"]
    monkeypatch.setattr(verify_module, "accept_probability", lambda p_x, q_x: 1.0)
    broken, _ = first_three(small_vocab_model, "ngram", params, 20_000)
    assert chi_square_two_sample(plain, broken) < 0.01


# -- stops inside an accepted run, per-request settings -------------------------------------------


def test_stops_and_max_tokens_cut_an_accepted_run_exactly(small_vocab_model):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (plain,) = tokens_of(run_batch(make_engine(small_vocab_model), [PATTERN_PROMPT], greedy))
    engine = make_engine(small_vocab_model, draft="ngram")
    (spec,) = tokens_of(run_batch(engine, [PATTERN_PROMPT], greedy))
    assert spec == plain and engine.metrics.spec.accepted_tokens > 0
    # a stop token first emitted at position k ends the output right there
    stop = next(t for t in plain[3:] if t not in plain[:3])
    cut = plain.index(stop) + 1
    stopped = run_batch(engine, [PATTERN_PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                 stop_token_ids=[stop]))[0].outputs[0]
    assert list(stopped.token_ids) == plain[:cut] and stopped.finish_reason == "stop"
    for max_tokens in (1, 2, 5):
        short = run_batch(engine, [PATTERN_PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True))[0].outputs[0]
        assert list(short.token_ids) == plain[:max_tokens] and short.finish_reason == "length"


def test_requests_choose_their_own_speculation(small_vocab_model):
    engine = make_engine(small_vocab_model, draft="ngram")
    off, capped, default = run_batch(engine, [PATTERN_PROMPT] * 3, [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculation={"enabled": False}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculation={"max_tree_tokens": 1}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ])
    assert off.metrics.spec.verify_steps == 0
    assert capped.metrics.spec.drafted_tokens <= capped.metrics.spec.verify_steps
    assert default.metrics.spec.verify_steps > 0
    assert tokens_of([off]) == tokens_of([capped]) == tokens_of([default])
    plain = make_engine(small_vocab_model)
    chosen = run_batch(plain, [PATTERN_PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                              speculation={"drafter": "ngram"}))[0]
    assert chosen.metrics.spec.verify_steps > 0 and tokens_of([chosen]) == tokens_of([default])


def test_suffix_decoding_drafts_from_the_outputs_requests_share(small_vocab_model):
    engine = make_engine(small_vocab_model, draft="suffix")
    cache = engine.drafter.cache
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 6, 2]
    (private,) = run_batch(engine, [prompt], SamplingParams(**greedy, speculation={"share_output": False}))
    assert cache.tokens == 0
    (first,) = run_batch(engine, [prompt], SamplingParams(**greedy))
    assert cache.tokens == 24 and tokens_of([first]) == tokens_of([private])
    (again,) = run_batch(engine, [prompt], SamplingParams(**greedy))  # its output is known now
    assert tokens_of([again]) == tokens_of([first])
    assert again.metrics.spec.accepted_tokens > first.metrics.spec.accepted_tokens
    gauges = engine.drafter_gauges()
    assert gauges[("suffix", "suffix_cache_tokens")] == 48 and gauges[("suffix", "suffix_cache_outputs")] == 2


def test_requests_choose_their_tree_shape(small_vocab_model, small_vocab_draft):
    engine = make_engine(small_vocab_model, draft=str(small_vocab_draft), max_tree_tokens=6)
    shapes = [{"tree": "chain", "max_depth": 2}, {"tree": "tree", "top_k": 3}, {"tree": "dynamic", "top_k": 2}, None]
    outs = run_batch(engine, [PATTERN_PROMPT] * len(shapes), [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculation=shape) for shape in shapes])
    chain = outs[0].metrics.spec
    assert chain.verify_steps > 0 and chain.drafted_tokens <= 2 * chain.verify_steps
    assert len(chain.accepted_at_depth) <= 2, "a chain of two accepts two drafted tokens at most"
    assert all(o.metrics.spec.verify_steps > 0 for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1, "every shape gives the target's own output"


def test_bad_speculation_fields_say_what_to_send():
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(speculation={"enable": True})
    with pytest.raises(ValueError, match="max_tree_tokens must be >= 0"):
        SamplingParams(speculation={"max_tree_tokens": -1})
    with pytest.raises(ValueError, match="tree 'wide': use one of chain, tree, dynamic"):
        SamplingParams(speculation={"tree": "wide"})
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        SamplingParams(speculation={"top_k": 0})
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        SamplingParams(speculation={"max_depth": 0})
    with pytest.raises(ValueError, match="share_output must be true or false"):
        SamplingParams(speculation={"share_output": "no"})


# -- modes, calibration, drafter errors ------------------------------------------------------------


def test_speculation_off_is_the_plain_engine(small_vocab_model):
    engine = make_engine(small_vocab_model, draft="ngram", speculation="off")
    assert engine.drafter is None
    out = run_batch(engine, [PATTERN_PROMPT] * 2, [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, speculation={"drafter": "ngram"}),
    ])
    assert all(o.metrics.spec.verify_steps == 0 for o in out) and engine.metrics.spec.verify_steps == 0


def test_adaptive_speculation_calibrates_once_per_machine(small_vocab_model, tmp_path, monkeypatch):
    from specserve import calibration

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    engine = make_engine(small_vocab_model, draft="ngram", speculation="adaptive", max_num_batched_tokens=64)
    cost = engine.policy.forward_cost
    assert cost is not None and cost.sizes == calibration.calibration_sizes(64) and all(t > 0 for t in cost.seconds)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached curve should have been used")

    monkeypatch.setattr(calibration, "measure", no_measuring)
    again = make_engine(small_vocab_model, draft="ngram", speculation="adaptive", max_num_batched_tokens=64)
    assert again.policy.forward_cost.seconds == cost.seconds
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert tokens_of(run_batch(again, [PATTERN_PROMPT], greedy)) == tokens_of(
        run_batch(make_engine(small_vocab_model), [PATTERN_PROMPT], greedy))
    assert again.block_manager.num_free_blocks == again.block_manager.num_blocks


def test_a_model_shorter_than_a_steps_token_budget_calibrates_within_its_length(small_vocab_model, tmp_path,
                                                                                 monkeypatch):
    """Calibration forwards a context then up to a whole step's tokens: never past the model's
    positions (256 here, a step's budget 1024), where its rotary tables end."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    engine = make_engine(small_vocab_model, draft="ngram", speculation="adaptive", max_num_batched_tokens=1024)
    assert engine.max_model_len < 1024
    assert max(engine.policy.forward_cost.sizes) <= engine.max_model_len


def test_head_errors_say_what_to_change(small_vocab_model, small_vocab_heads, tiny_checkpoint, tmp_path):
    engine = make_engine(small_vocab_model, draft="ngram")
    with pytest.raises(ValueError, match="is not loaded .* start the engine with --draft"):  # its K/V need the pool
        engine.add_request("x", PATTERN_PROMPT, SamplingParams(speculation={"drafter": "feature"}))
    with pytest.raises(FileNotFoundError, match="train-drafter"):
        make_engine(small_vocab_model, draft=f"feature:{tmp_path}")
    with pytest.raises(ValueError, match="holds a feature head, not an early-exit head"):
        make_engine(small_vocab_model, draft=f"early-exit:{small_vocab_heads['feature']}")
    with pytest.raises(ValueError, match="no shipped feature head for this target"):
        make_engine(small_vocab_model, draft="feature")
    other = tiny_checkpoint(vocab_size=VOCAB, eos_token_id=7, bos_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((small_vocab_model / name).read_bytes())
    with pytest.raises(ValueError, match="was trained for 'vocab8', not the target this engine serves"):
        make_engine(other, draft=f"feature:{small_vocab_heads['feature']}")


def test_drafter_errors_say_what_to_change(small_vocab_model, small_vocab_draft):
    engine = make_engine(small_vocab_model, draft="ngram")
    with pytest.raises(ValueError, match="is not loaded .* start the engine with --draft"):
        engine.add_request("x", PATTERN_PROMPT, SamplingParams(speculation={"drafter": str(small_vocab_draft)}))
    with pytest.raises(ValueError, match=r"early exit needs K in \[1, 1\]"):
        make_engine(small_vocab_model, draft="early-exit:5")
    with_draft = make_engine(small_vocab_model, draft=str(small_vocab_draft))  # loaded at start: usable per request
    merged = {"drafter": f"ngram+{small_vocab_draft}"}
    out = run_batch(with_draft, [PATTERN_PROMPT],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, speculation=merged))
    assert out[0].metrics.spec.verify_steps > 0


# -- trained heads: sampled trees keep the distribution ---------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_heads(tmp_path_factory, small_vocab_model):
    """An untrained (random) head of each kind for the 8-token model: drafts that are often wrong."""
    from drafters.heads import HeadConfig, save_head, target_fingerprint
    from specserve.models.loader import load_model
    from specserve.training.heads import TrainableHead

    target = load_model(small_vocab_model, torch.float32)
    heads = {}
    for kind, layer in (("feature", target.config.num_layers), ("early-exit", 1)):
        torch.manual_seed(3)
        head = TrainableHead(target, kind, layer, torch.arange(VOCAB))
        with torch.no_grad():  # an early-exit head starts as the target's next layer: make it differ
            for param in head.layer.parameters():
                param.add_(torch.randn_like(param) * 0.3)
        directory = tmp_path_factory.mktemp(f"head-{kind}")
        save_head(directory, HeadConfig(kind, "vocab8", target_fingerprint(small_vocab_model), layer, VOCAB),
                  head.tensors())
        heads[kind] = directory
    return heads


@pytest.mark.parametrize("kind", ["feature", "early-exit"])
def test_sampled_head_trees_keep_the_distribution(small_vocab_model, small_vocab_heads, kind, chi_square_two_sample):
    """A head's children sampled from its q without replacement, verified against q: half the
    draws from chains (runs of sampled tokens accepted in a row), half from branching trees."""
    spec = f"{kind}:{small_vocab_heads[kind]}"
    chains, chain_engine = first_three(small_vocab_model, spec, SAMPLING["T=1"], 6_000, draft_top_k=1, draft_beam=1)
    trees, tree_engine = first_three(small_vocab_model, spec, SAMPLING["T=1"], 6_000, draft_top_k=2, draft_beam=2)
    assert len(chain_engine.metrics.spec.accepted_at_depth) > 1, "some steps accept two sampled tokens in a row"
    assert tree_engine.drafter.max_children >= 2 and tree_engine.metrics.spec.accepted_tokens > 0
    assert chain_engine.drafter.sampled_nodes > 1000 and tree_engine.drafter.sampled_nodes > 1000
    p_value = chi_square_two_sample(plain_counts(small_vocab_model, "T=1"), chains + trees)
    assert p_value > 0.01, f"{kind} head speculation changed the distribution (p = {p_value:.2e})"


@pytest.mark.parametrize("kind", ["feature", "early-exit"])
def test_beside_a_target_in_quantized_blocks_a_head_runs_8_bit_blocks_in_one_call(tiny_checkpoint, smollm2_path,
                                                                            tmp_path, kind):
    """On a CPU serving quantized blocks, a head's projections are requantized to 8-bit blocks
    and its layer runs as one C++ call computing its modules' bits; it drafts only tokens of its
    draft vocabulary, and greedy output stays the target's."""
    from drafters.heads import HEAD_BITS, HeadConfig, save_head, target_fingerprint
    from specserve.model_runner import TreeRequest
    from specserve.training.heads import TrainableHead
    from specserve.tree import TokenTree

    path = tiny_checkpoint(seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((smollm2_path / name).read_bytes())
    plain = LLMEngine(path, "float32", EngineConfig(quantization="int4", speculation="off"))
    torch.manual_seed(5)
    vocab_ids = torch.randperm(plain.model.config.vocab_size)[:128].sort().values
    layer = plain.model.config.num_layers if kind == "feature" else 1
    head = TrainableHead(plain.model, kind, layer, vocab_ids)
    save_head(tmp_path / "head", HeadConfig(kind, "tiny", target_fingerprint(path), layer, len(vocab_ids)),
              head.tensors())
    engine = LLMEngine(path, "float32", EngineConfig(quantization="int4", draft=f"{kind}:{tmp_path / 'head'}",
                                                     speculation="fixed", max_tree_tokens=6, draft_top_k=2,
                                                     draft_beam=2))
    drafter = engine.drafter
    assert drafter.stack is not None
    assert all(w.bits == HEAD_BITS for p in drafter._projections() for w in p.quantized)
    requests = [TreeRequest(TokenTree.chain([3, 9, 27, 81]), 0, [0, 1])]
    x = torch.randn(4, plain.model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        stacked = drafter.target_runner.run_layer(drafter.layer, drafter.cache, requests, x, drafter.stack)
        modules = drafter.target_runner.run_layer(drafter.layer, drafter.cache, requests, x)
    assert torch.equal(stacked, modules)

    drafted: set[int] = set()
    propose = drafter.propose

    def recording(draft_requests):
        drafts = propose(draft_requests)
        drafted.update(t for d in drafts for t in d.tree.tokens[1:])
        return drafts

    drafter.propose = recording
    prompts = [[1, 17, 33, 17, 33, 17], [2, 5, 8, 13, 21]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = run_batch(engine, prompts, greedy)
    assert tokens_of(outputs) == tokens_of(run_batch(plain, prompts, greedy))
    assert engine.metrics.spec.drafted_tokens > 0 and drafted <= set(vocab_ids.tolist())
