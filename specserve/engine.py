"""The synchronous engine: `add_request`, then `step()` until done. One step is five phases,
each a value handed to the next:

    Scheduler.schedule()  -> StepPlan        who runs, prefill chunks, a tree budget each
    Drafter.propose()     -> Drafts          trees rooted at each decoding sequence's last token
    ModelRunner.forward() -> ForwardResult   one target pass over every chain and tree
    verify_batch()        -> Verdicts        every tree at once (a decode: its root alone)
    commit                -> StepRecord      tokens appended, accepted K/V kept; the policy learns

The asynchronous engine (`specserve.async_engine`) runs this same loop in a thread.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch

from drafters import (
    Draft,
    Drafter,
    DrafterOptions,
    DrafterSpec,
    DraftRequest,
    DraftTarget,
    build_drafter,
    build_part_drafter,
)
from drafters.base import Commit, Ended, Observes, OwnsKV, UsesTarget
from drafters.draft_model import DraftModelDrafter
from kernels.metadata import compaction_slots
from specserve.block_manager import BlockManager
from specserve.calibration import load_or_measure
from specserve.config import EngineConfig, gpu_kv_budget
from specserve.cuda_graphs import padded_sizes
from specserve.detokenizer import TextStream, load_tokenizer
from specserve.frontend import Frontend, Limits
from specserve.kv_cache import KVCache
from specserve.model_runner import ForwardResult, ModelRunner, RequestRows, TreeRequest
from specserve.models.config import ModelConfig
from specserve.models.loader import load_model
from specserve.outputs import RequestOutput, completion_output, request_metrics
from specserve.parallel import (
    StepCall,
    TensorParallelExecutor,
    TensorParallelRunner,
    TensorShard,
    check_shardable,
    local_config,
    start_workers,
)
from specserve.sampling import SamplingParams, normalized_drafter_spec
from specserve.scheduler import ScheduledSequence, Scheduler
from specserve.sequence import Sequence, SpecStats, TokenLogprob
from specserve.speculation import AdaptivePolicy, FixedPolicy, SpeculationPolicy, StepRecord
from specserve.tree import TokenTree
from specserve.verify import Candidate, Logprob, Verdict, verify_batch

logger = logging.getLogger("specserve")

Prompt = str | list[int]
OWN_KV_KINDS = ("model", "feature", "early-exit-head")  # drafter kinds with K/V of their own in the pool
MAX_CACHED_DRAFTERS = 32  # drafter combinations requests named, kept for reuse


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model_path: str | Path, dtype: str | torch.dtype | None = None,
                 config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model_path = Path(model_path)
        device = self.config.torch_device
        world = self.config.tensor_parallel_size
        # Split plain weights only: a GGUF's own blocks ("auto") become its exactly dequantized ones
        split = self.config.splits_target
        quantization = "none" if split and self.config.quantization == "auto" else self.config.quantization
        self.executor: TensorParallelExecutor | None = None  # ranks 1.. of a split target
        if split:
            check_shardable(ModelConfig.from_dir(self.model_path), world)
            self.executor = start_workers(world, model_path, dtype, quantization, self.config.load_format, device)
        try:
            self._build(dtype, quantization, device)
        except BaseException:
            self.close()
            raise

    def _build(self, dtype: str | torch.dtype | None, quantization: str, device: torch.device) -> None:
        model_path = self.model_path
        shard = None if self.executor is None else TensorShard(0, self.executor.world)
        self.model = load_model(model_path, dtype, quantization, self.config.load_format, device, shard=shard)
        # A dummy model's directory may hold no tokenizer (configs/models/): a synthetic one then
        self.tokenizer = load_tokenizer(model_path, self.model.config if self.config.load_format == "dummy" else None)
        model_config = self.model.config
        block_size = self.config.block_size
        # Drafters load first: a draft model's K/V share the block tables, so they share the pool.
        top_k, beam = self.config.draft_shape(device)
        self._draft_options = DrafterOptions(top_k=top_k, beam=beam, dtype=self.model.dtype, device=device,
                                             vocab=self.config.draft_vocab,
                                             quantization=self.config.draft_quantization_for(device),
                                             default_vocab=self.config.default_draft_vocab(device),
                                             load_format=self.config.load_format)
        self._parts: dict[str, Drafter] = {}  # every drafter part built so far, by spec (loaded once)
        self._draft_target: DraftTarget | None = None
        self.drafter = self._build_drafter(self.config.draft, at_start=True)
        self.kv_dtype = self.config.kv_dtype(self.model.dtype)  # the target's pool (drafters keep their own dtype)
        # This rank's share of the heads (the whole model's without tensor parallelism)
        pool_config = local_config(model_config, self.config.tensor_parallel_size)
        per_block = KVCache.bytes_per_block(pool_config, block_size, self.kv_dtype)
        per_block += sum(d.kv_bytes_per_block(block_size, model_config, self.model.dtype)
                         for d in self._parts.values() if isinstance(d, OwnsKV))
        self.kv_bytes_per_block = per_block  # the target's K/V and every drafter's own
        fraction = self.config.gpu_memory_fraction if device.type == "cuda" else None
        kv_bytes = self.config.kv_cache_bytes if fraction is None else self._gpu_kv_bytes(device, fraction)
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv cache memory of {kv_bytes} bytes holds no block "
                             f"({per_block} bytes each): raise --kv-cache-memory")
        self.kv_cache = KVCache.for_model(pool_config, num_blocks, block_size, self.kv_dtype, device)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.policy: SpeculationPolicy = AdaptivePolicy() if self.config.speculation == "adaptive" else FixedPolicy()
        self.scheduler = Scheduler(self.config, self.block_manager, self.policy)
        self.runner = (ModelRunner(self.model, self.kv_cache) if self.executor is None
                       else TensorParallelRunner(self.model, self.kv_cache, self.executor))
        self._draft_target = DraftTarget(self.runner, num_blocks, block_size, model_config.vocab_size, self.model_path)
        for part in self._parts.values():
            if isinstance(part, UsesTarget):
                part.attach(self._draft_target)
        self.num_kv_tokens = num_blocks * block_size
        self.max_model_len = min(self.config.max_model_len or model_config.max_model_len,
                                 model_config.max_model_len, self.num_kv_tokens)
        self.frontend = Frontend(self.tokenizer, Limits(model_config.vocab_size, self.max_model_len,
                                                        model_config.max_model_len, self.num_kv_tokens))
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = count()
        # Drafters requests named, by normalised spec, least recently used first; bounded, since
        # every client may name its own combination (the engine's own drafter is never evicted).
        self._default_spec = normalized_drafter_spec(self.config.draft)
        self._drafters: OrderedDict[str, Drafter | None] = OrderedDict({self._default_spec: self.drafter})
        self.metrics = EngineMetrics()
        # Called with (request id, drafted tree, accepted path) after every verification: what
        # `specserve ablate` draws its tree shapes from.
        self.tree_observers: list[Callable[[str, TokenTree, list[int]], None]] = []
        if device.type == "cuda" and not self.config.enforce_eager and self.executor is None:
            self._capture_graphs()  # before calibration, which then measures the steps as they will run
        if self.drafter is not None:
            self._calibrate()
        # Everything alive now (the model's modules, tokenizer, imported libraries: ~360k objects
        # with transformers loaded) lives as long as the engine. Left to the cyclic garbage
        # collector, every full collection walks them all, a 0.1-0.2 s pause in the middle of a
        # step (a few per thousand steps, more where drafters allocate per token); frozen,
        # collections walk only what serving allocates.
        gc.collect()
        gc.freeze()
        self.info = self._describe()
        logger.info("serving %s on %s: %s weights, %s activations, kernels %s, drafter %s", self.model_path.name,
                    self.info["device"], self.info["weights"], self.info["dtype"], self.info["kernels"],
                    self.info["drafter"])
        logger.info("KV cache: %d blocks x %d = %d tokens (%.0f MiB, %s, %d bytes a token); max_model_len %d",
                    num_blocks, block_size, self.num_kv_tokens, num_blocks * per_block / 2**20,
                    self.info["kv_cache_dtype"], per_block // block_size, self.max_model_len)

    def _gpu_kv_bytes(self, device: torch.device, fraction: float) -> int:
        """The KV pool's bytes on a GPU: `fraction` of its memory less what the weights (drafters'
        included) and a forward of a full step's tokens take, measured (vLLM's profiling run)."""
        tokens = min(self.config.max_num_batched_tokens, self.model.config.max_model_len)
        block_size = self.config.block_size
        blocks = -(-tokens // block_size)
        world = self.config.tensor_parallel_size
        scratch = KVCache.for_model(local_config(self.model.config, world), blocks, block_size, self.kv_dtype,
                                    device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        request = TreeRequest(TokenTree.chain([0] * tokens), 0, list(range(blocks)))
        if self.executor is None:
            ModelRunner(self.model, scratch).forward([request])
        else:  # every rank runs it: the forward's collectives need them all
            self.executor.send(StepCall("profile", [request], pool=(blocks, block_size, self.kv_dtype)))
            with self.executor.collectives():
                ModelRunner(self.model, scratch).forward([request])
        torch.cuda.synchronize(device)
        in_use = torch.cuda.max_memory_allocated(device) - 2 * scratch.k.numel() * scratch.k.element_size()
        del scratch
        torch.cuda.empty_cache()
        return gpu_kv_budget(torch.cuda.mem_get_info(device)[1], in_use, fraction)

    def _capture_graphs(self) -> None:
        """CUDA graphs for the target's small steps (decodes, trees of up to max_tree_tokens drafted
        nodes) and, at the same sizes, for the draft models' forwards."""
        cfg = self.config
        width = 1 if cfg.speculation == "off" else cfg.max_tree_tokens + 1
        blocks = -(-(self.max_model_len + width) // cfg.block_size)
        sizes = padded_sizes(cfg.max_num_batched_tokens, cfg.max_num_seqs, (1, width), blocks, self.max_model_len)
        drafters = [self.drafter, *self._parts.values()]  # a merged drafter reads what its parts do together
        hidden_sets = [(), *(d.hidden_wanted() for d in drafters if isinstance(d, Observes))]
        self.runner.capture_graphs(sizes, hidden_sets)
        for part in self._parts.values():
            if isinstance(part, DraftModelDrafter) and part.runner is not None:
                part.runner.capture_graphs(sizes)

    def _describe(self) -> dict[str, str]:
        """What this engine runs on and with: the CPU, dtype, weight format, kernels, default drafter."""
        from kernels import native, ops
        from specserve.machine import processor_name
        from specserve.models.huge_pages import huge_page_bytes

        weights = self.model.weight_format()
        if self.config.load_format == "dummy":
            weights = f"dummy (random) {weights}"
        device = self.kv_cache.k.device
        attention = ops.backend(device, self.model.dtype)
        if device.type == "cpu":
            ours = "blocks" in weights or attention == "cpu"
            kernels = f"specserve-cpu {native.isa()}" if ours else "torch"
            if ours and "blocks" not in weights:
                kernels += " (attention), torch (matmuls)"
            if huge_page_bytes(self.model):
                kernels += ", tiles in huge pages"
        else:
            graphs = len(self.runner.graphs) if self.runner.graphs is not None else 0
            kernels = f"{attention} (attention), torch (matmuls), " + (f"{graphs} CUDA graphs" if graphs else "eager")
        name = processor_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
        return {"cpu": processor_name(), "device": f"{device.type}: {name}",
                "dtype": str(self.model.dtype).removeprefix("torch."), "weights": weights, "kernels": kernels,
                "drafter": self.config.draft, "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "tensor_parallel_size": str(self.config.tensor_parallel_size)}

    # -- requests ---------------------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt; with `chat`, wrap it as one user turn in the model's chat template."""
        return self.frontend.encode(prompt, chat)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.frontend.encode_chat(messages)

    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError, saying what to change, for a request that could never be served."""
        self.frontend.validate(prompt_ids, params)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    prompt_ids: list[int] | None = None) -> None:
        """Queue a request. `prompt_ids`, when the caller already tokenized a text `prompt`, saves doing it again."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running: use a unique id")
        text = prompt if isinstance(prompt, str) else None
        if prompt_ids is None:
            prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        drafter, max_tree_tokens = self._speculation_for(params)
        seqs: list[Sequence] = []
        for index in range(params.n):
            seqs.append(Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=index, prompt_ids=prompt_ids,
                params=params, text=TextStream(self.tokenizer, prompt_ids, params.stop), stop_ids=stop_ids,
                generator=_generator(params.seed, index),
                waits_for=seqs[0] if index and self.config.enable_prefix_caching else None,
                drafter=drafter, max_tree_tokens=max_tree_tokens,
            ))
        self.requests[request_id] = _Request(request_id, text, prompt_ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown/done)."""
        return self._end(request_id, "abort")

    def _end(self, request_id: str, reason: str, error: Exception | None = None) -> RequestOutput | None:
        """Finish every sequence of a request now (`reason`: "abort" or "error"), freeing its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
                self._finish(seq)
        out = self._output(request, {})
        if error is not None:
            logger.error("request %s failed alone (the engine goes on): %s", request_id, error, exc_info=error)
            self.metrics.failed_requests += 1
            out.error = f"{type(error).__name__}: {error}"
        return out

    def drafter_gauges(self) -> dict[tuple[str, str], float]:
        """What the loaded drafters hold now, by (drafter spec, gauge name): for `/metrics`."""
        parts = list(self._parts.values())  # the engine thread may add one meanwhile
        return {(part.spec, name): value for part in parts for name, value in part.gauges().items()}

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine serves nothing more)."""
        if self.executor is not None:
            self.executor.close()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched forward and return an output for every request that advanced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not schedule any waiting sequence (a bug: "
                                   "requests that cannot fit are rejected when added)")
            return []
        self.metrics.steps += 1
        for seq in plan.preempted:  # its blocks are gone, and with them any draft K/V
            _release(seq)
        drafts = self._propose(plan.scheduled, plan.token_seconds)
        start = time.perf_counter()
        forward = self.runner.forward([self._tree_request(s, drafts.get(s.seq.seq_id)) for s in plan.scheduled],
                                      hidden_at=_hidden_wanted(plan.scheduled))
        if drafts:
            self.metrics.target_s += time.perf_counter() - start
        # From here on an error in one sequence's work fails its request alone (see `_containing`).
        failed: dict[str, RequestOutput] = {}
        verdicts = self._verify(plan.scheduled, drafts, forward, failed)
        deltas: dict[str, dict[int, tuple[str, list[int]]]] = {}
        verified: list[tuple[Drafter, int, bool]] = []  # each tree's drafter, accepted tokens, rejection
        for b, s in enumerate(plan.scheduled):
            if s.seq.request_id in failed:  # another sample of its request failed in this step
                continue
            with self._containing(s.seq, failed):
                delta = self._commit(s, drafts.get(s.seq.seq_id), forward[b], verdicts.get(b), verified)
                if delta is not None:
                    deltas.setdefault(s.seq.request_id, {})[s.seq.index] = delta
        self.policy.observe(StepRecord(plan.shape, drafts.num_drafted, time.perf_counter() - start, verified))
        outputs = [self._output(self.requests[rid], d) for rid, d in deltas.items() if rid not in failed]
        return outputs + list(failed.values())

    @contextmanager
    def _containing(self, seq: Sequence, failed: dict[str, RequestOutput]) -> Iterator[None]:
        """One sequence's share of a step (sampling, verifying, detokenizing): an error there
        fails its request alone, with the cause, and the step goes on for the others."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 -- contained: reported in the request's output
            out = self._end(seq.request_id, "error", error)
            if out is not None:
                failed[seq.request_id] = out

    # -- speculation ----------------------------------------------------------------------------

    def _speculation_for(self, params: SamplingParams) -> tuple[Drafter | None, int]:
        """The drafter and tree cap of a new request: the engine's, unless the request says otherwise."""
        spec = params.speculation
        if self.config.speculation == "off":
            return None, 0
        if spec is None:
            return self.drafter, self.config.max_tree_tokens
        if not spec.enabled:
            return None, 0
        drafter = self.drafter if spec.drafter is None else self._requested_drafter(spec.drafter)
        cap = self.config.max_tree_tokens if spec.max_tree_tokens is None else spec.max_tree_tokens
        if drafter is not None:
            self._calibrate()
        return drafter, cap

    def _requested_drafter(self, spec: str) -> Drafter | None:
        """The drafter a request names (`spec` normalised by SpeculationParams), built on first use."""
        if spec in self._drafters:
            self._drafters.move_to_end(spec)
            return self._drafters[spec]
        drafter = self._build_drafter(spec, at_start=False)
        self._drafters[spec] = drafter
        if len(self._drafters) > MAX_CACHED_DRAFTERS:
            oldest = next(k for k in self._drafters if k != self._default_spec)
            del self._drafters[oldest]  # sequences using it keep it; later requests rebuild it from parts
        return drafter

    def _calibrate(self) -> None:
        """The adaptive policy needs the forward cost curve: cached, or measured once now."""
        if isinstance(self.policy, AdaptivePolicy) and self.policy.forward_cost is None:
            self.policy.calibrate(load_or_measure(self.runner, self.block_manager, self.config.max_num_batched_tokens,
                                                  self.model_path, max_len=self.max_model_len))

    def _build_drafter(self, spec: str, at_start: bool) -> Drafter | None:
        """A drafter for `spec`, reusing parts already built. Drafters with K/V of their own (draft
        models, trained heads) load only at start-up, where their K/V are counted into the pool;
        requests may name them afterwards."""
        if at_start and self.config.speculation == "off":
            return None

        def part(p: DrafterSpec) -> Drafter:
            key = str(p)
            if key not in self._parts:
                if p.kind in OWN_KV_KINDS and not at_start:
                    raise ValueError(f"drafter {key!r} is not loaded (its K/V share the pool, sized at start-up): "
                                     f"start the engine with --draft {key} (or a spec containing it) to use it per "
                                     "request")
                drafter = build_part_drafter(p, self._draft_options)
                if self._draft_target is not None and isinstance(drafter, UsesTarget):
                    drafter.attach(self._draft_target)
                self._parts[key] = drafter
            return self._parts[key]

        return build_drafter(spec, self._draft_options, part)

    def _propose(self, scheduled: list[ScheduledSequence], token_seconds: float | None) -> Drafts:
        """A draft per sequence the scheduler gave a tree budget (none where a drafter found nothing)."""
        groups: dict[int, tuple[Drafter, list[ScheduledSequence]]] = {}
        for s in scheduled:
            if s.tree_budget and s.seq.drafter is not None:
                groups.setdefault(id(s.seq.drafter), (s.seq.drafter, []))[1].append(s)
        drafts = Drafts()
        for drafter, group in groups.values():
            start = time.perf_counter()
            try:
                proposed = drafter.propose([self._draft_request(s, token_seconds) for s in group])
                for s, draft in zip(group, proposed, strict=True):
                    if draft.tree.tokens[0] != s.seq.token_ids[-1] or draft.num_drafted > s.tree_budget:
                        raise RuntimeError(f"drafter {drafter.spec!r} broke its contract: a tree must be rooted at "
                                           f"the last token and hold at most {s.tree_budget} drafted nodes")
            except Exception as error:  # noqa: BLE001 -- a drafter's failure costs its sequences one step's speculation
                self._drafter_failed(drafter, [s.seq for s in group], error)
                continue
            finally:
                self.metrics.draft_s += time.perf_counter() - start
            drafts.trees.update((s.seq.seq_id, d) for s, d in zip(group, proposed, strict=True) if d.num_drafted)
        return drafts

    def _observe(self, s: ScheduledSequence, rows: RequestRows, path: list[int]) -> None:
        """A drafter that learns from commits sees this one: the tokens, and the target's
        hidden states of the committed rows (the chunk, then the accepted path)."""
        drafter = s.seq.drafter
        if not isinstance(drafter, Observes) or s.seq.is_finished:
            return
        hidden = rows.hidden
        if hidden and path == list(range(len(path))):  # the rows in order (a decode, a chain): a view
            hidden = {k: h[: s.num_tokens + len(path) - 1] for k, h in hidden.items()}
        elif hidden:
            keep = torch.tensor([*range(s.num_tokens - 1), *(s.num_tokens - 1 + node for node in path)])
            hidden = {k: h[keep] for k, h in hidden.items()}
        try:
            drafter.observe(Commit(s.seq.seq_id, s.seq.token_ids, s.context_len, hidden))
        except Exception as error:  # noqa: BLE001 -- see _drafter_failed
            self._drafter_failed(drafter, [s.seq], error)

    def _drafter_failed(self, drafter: Drafter, seqs: list[Sequence], error: Exception) -> None:
        """A drafter that raises: its sequences go on without speculation this step, and its state
        for them is dropped (rebuilt from their tokens, as after a preemption)."""
        logger.warning("drafter %r failed; %d sequence(s) go on without speculation this step: %s",
                       drafter.spec, len(seqs), error, exc_info=error)
        self.metrics.drafter_errors += 1
        for seq in seqs:
            _release(seq)

    @staticmethod
    def _draft_request(s: ScheduledSequence, token_seconds: float | None) -> DraftRequest:
        spec = s.seq.params.speculation
        shape = top_k = None
        depth = s.tree_budget
        if spec is not None:
            shape, top_k, depth = spec.tree, spec.top_k, min(depth, spec.max_depth or depth)
        return DraftRequest(s.seq.seq_id, s.seq.token_ids, tree_budget=s.tree_budget, max_depth=depth,
                            block_table=s.seq.block_table.block_ids, temperature=s.seq.params.temperature,
                            generator=s.seq.generator, token_seconds=token_seconds, shape=shape, top_k=top_k)

    def _tree_request(self, s: ScheduledSequence, draft: Draft | None) -> TreeRequest:
        table = s.seq.block_table.block_ids
        if draft is not None:  # root = the sequence's last token, then the drafted nodes: logits for all
            return TreeRequest(draft.tree, s.context_len, table, "all")
        return TreeRequest(s.tree(), s.context_len, table, "last" if s.samples else "none")

    def _verify(self, scheduled: list[ScheduledSequence], drafts: Drafts, forward: ForwardResult,
                failed: dict[str, RequestOutput]) -> dict[int, Verdict]:
        """Every sequence that samples this step, as a tree (a decode or a prompt's last chunk: its
        root alone), verified at once; then all accepted K/V moved into place in one compaction.
        Returns the verdicts by position in `scheduled`."""
        start = time.perf_counter()
        sampling = [b for b, s in enumerate(scheduled) if s.samples]
        candidates = [self._candidate(scheduled[b], drafts.get(scheduled[b].seq.seq_id)) for b in sampling]
        try:
            verdicts = dict(zip(sampling, verify_batch(candidates, forward.logits), strict=True))
        except Exception:  # noqa: BLE001 -- find whose tree it was: each alone, failing only those that raise
            verdicts = {}
            for b, candidate in zip(sampling, candidates, strict=True):
                with self._containing(scheduled[b].seq, failed):
                    verdicts[b] = verify_batch([candidate], forward[b].logits)[0]
        src: list[int] = []
        dst: list[int] = []
        for b, verdict in verdicts.items():
            s = scheduled[b]
            if s.seq.seq_id in drafts and verdict.error is None:
                moves = compaction_slots(s.seq.block_table.block_ids, s.context_len, verdict.path,
                                         self.block_manager.block_size)
                src += moves[0]
                dst += moves[1]
        self.runner.compact(src, dst)
        if drafts:  # a speculative step's share, as target_s
            self.metrics.verify_s += time.perf_counter() - start
        return verdicts

    @staticmethod
    def _candidate(s: ScheduledSequence, draft: Draft | None) -> Candidate:
        tree = draft.tree if draft is not None else TokenTree.single(s.seq.token_ids[-1])
        return Candidate(tree, s.seq.sampling_row(), draft.probs if draft is not None else {}, s.seq.params.logprobs)

    def _commit(self, s: ScheduledSequence, draft: Draft | None, rows: RequestRows, verdict: Verdict | None,
                verified: list[tuple[Drafter, int, bool]]) -> tuple[str, list[int]] | None:
        """A sequence's share of the step made final: its chunk (or root) and accepted nodes are
        computed, the tokens it emits appended (a stop or max_tokens may cut them short), its
        full blocks hashed and its rejected nodes' blocks returned; its tree's outcome goes into
        `verified` (for the step's record). None: it emits nothing."""
        seq = s.seq
        seq.spec_stats.target_forwards += 1
        if verdict is not None and verdict.error is not None:
            raise verdict.error
        path = verdict.path if verdict is not None else [0]
        seq.num_computed += s.num_tokens - 1 + len(path)  # the accepted nodes' K/V are now contiguous
        seq.num_forwarded_tokens += s.num_tokens - 1 + (len(draft.tree) if draft is not None else 1)
        self.block_manager.commit(seq.block_table, seq.token_ids, min(seq.num_computed, len(seq.token_ids)))
        if draft is not None:
            rejected = bool(draft.tree.children[path[-1]])  # else the accepted path ran to a leaf
            seq.spec_stats.record(draft.num_drafted, verdict.num_accepted, rejected)
            self.metrics.spec.record(draft.num_drafted, verdict.num_accepted, rejected)
            for observe in self.tree_observers:
                observe(seq.request_id, draft.tree, path)
            verified.append((seq.drafter, verdict.num_accepted, rejected))
        if verdict is None:
            self._observe(s, rows, path)
            return None
        text, emitted = "", []
        for index, token in enumerate(verdict.tokens):
            text += self._append(seq, token, verdict.logprobs[index] if verdict.logprobs is not None else None)
            emitted.append(token)
            if seq.is_finished:
                return text, emitted
        self.block_manager.commit(seq.block_table, seq.token_ids, seq.num_computed)
        self.block_manager.trim(seq.block_table, seq.num_computed + 1)  # rejected nodes' blocks go back
        self._observe(s, rows, path)
        return text, emitted

    # -- outputs ----------------------------------------------------------------------------------

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None) -> str:
        if seq.logprobs is not None and logprob is not None:
            value, top = logprob
            seq.logprobs.append(TokenLogprob(token, value, dict(top)))
            seq.cumulative_logprob += value
        delta = seq.append(token)
        if seq.finish_reason is not None:
            self._finish(seq)
        return delta

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        _ended(seq)
        _release(seq)

    def _output(self, request: _Request, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
        outputs = [completion_output(seq, *deltas.get(seq.index, ("", []))) for seq in request.seqs]
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_ids, outputs, finished,
                             request_metrics(request.seqs))

    def check_invariants(self) -> None:
        """Every KV block is free, in the prefix cache, or held by a live sequence (tests call this)."""
        live = [s.block_table for r in self.requests.values() for s in r.seqs if not s.is_finished]
        self.block_manager.check_invariants(live)


@dataclass
class EngineMetrics:
    """Engine-wide counters since start: speculation totals and where speculative steps spend time."""

    steps: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    draft_s: float = 0.0  # drafters proposing trees
    target_s: float = 0.0  # target forwards of steps that verified at least one tree
    verify_s: float = 0.0  # verifying the step's trees (its decodes' too) and compacting accepted K/V
    failed_requests: int = 0  # requests failed alone by an error in their own work (sampling, detokenizing)
    drafter_errors: int = 0  # drafter calls that raised (their sequences went without speculation that step)


@dataclass
class Drafts:
    """A step's proposals, by sequence id (a sequence without one runs its chunk or root alone)."""

    trees: dict[int, Draft] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.trees)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.trees

    def get(self, seq_id: int) -> Draft | None:
        return self.trees.get(seq_id)

    @property
    def num_drafted(self) -> int:
        return sum(d.num_drafted for d in self.trees.values())


def _ended(seq: Sequence) -> None:
    """Tell the sequence's drafter all it produced (a drafter that fails here is logged, not fatal)."""
    if not isinstance(seq.drafter, Observes):
        return
    spec = seq.params.speculation
    try:
        seq.drafter.ended(Ended(seq.seq_id, seq.prompt_ids, seq.output_ids, spec is None or spec.share_output))
    except Exception:  # noqa: BLE001 -- the sequence is done either way
        logger.warning("drafter %r failed to take ended sequence %d", seq.drafter.spec, seq.seq_id, exc_info=True)


def _release(seq: Sequence) -> None:
    """Drop the drafter's state for `seq` (a drafter that fails here is logged, not fatal)."""
    if seq.drafter is None:
        return
    try:
        seq.drafter.release(seq.seq_id)
    except Exception:  # noqa: BLE001 -- the sequence is done with it either way
        logger.warning("drafter %r failed to release sequence %d", seq.drafter.spec, seq.seq_id, exc_info=True)


def _hidden_wanted(scheduled: list[ScheduledSequence]) -> tuple[int, ...]:
    """The target hidden states the step's drafters read (none: the forward keeps none)."""
    drafters = {id(s.seq.drafter): s.seq.drafter for s in scheduled if isinstance(s.seq.drafter, Observes)}
    return tuple(sorted({k for d in drafters.values() for k in d.hidden_wanted()}))


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Per-sample generator: seeded output does not depend on what else is in the batch."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed if index == 0 else hash((seed, index)) & (2**63 - 1))
