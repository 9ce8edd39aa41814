"""Trained drafter heads: an early-exit head and an EAGLE-style feature head.

Both are one decoder layer of the target's shape, trained by `specserve train-drafter` on the
target's hidden states (which the engine hands them with every commit), with a one-layer cache
of their own and a draft vocabulary scored through rows of the target's LM head. How each
drafts: docs/design.md.

A head lives in a directory: `head.json` (`HeadConfig`: kind, the target it belongs to and
its fingerprint, how it was trained) and `head.safetensors` (`layer.*` in Hugging Face names,
`fc.*` for a feature head, `vocab_ids`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters.base import Commit, DraftTarget, Observes, OwnsKV
from drafters.tree_search import TreeSearchDrafter, _Search
from specserve.kv_cache import KVCache
from specserve.model_runner import TreeRequest
from specserve.models.config import ModelConfig
from specserve.models.linear import Projection, packing_available
from specserve.models.llama import DecoderLayer, LlamaForCausalLM, build_decoder_stack
from specserve.tree import TokenTree

HEAD_KINDS = ("feature", "early-exit")
HEAD_BITS = 8  # a head's projections on a CPU serving quantized blocks (`HeadDrafter._quantize_like`)
CONFIG_FILE, WEIGHTS_FILE = "head.json", "head.safetensors"
SHIPPED_DIR = Path(__file__).parent / "trained"  # heads shipped with specserve: <target>/<kind>/


@dataclass
class HeadConfig:
    kind: str  # "feature" or "early-exit"
    target: str  # the name of the target it was trained for
    target_fingerprint: str  # `target_fingerprint` of that target's directory
    layer: int  # the hidden state it reads: early-exit K (the stream entering layer K); feature: num_layers
    vocab_size: int  # tokens in its draft vocabulary
    training: dict = field(default_factory=dict)  # settings, wall time, validation agreement per epoch

    def save(self, directory: Path) -> None:
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> HeadConfig:
        path = Path(directory) / CONFIG_FILE
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not a drafter head: it has no {CONFIG_FILE} "
                                    "(train one with `specserve train-drafter`)")
        data = json.loads(path.read_text())
        if data.get("kind") not in HEAD_KINDS:
            raise ValueError(f"{path}: kind {data.get('kind')!r} is not one of {', '.join(HEAD_KINDS)}")
        return cls(**data)


def save_head(directory: Path, config: HeadConfig, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE))
    config.save(directory)


def target_fingerprint(model_dir: Path) -> str:
    """Identifies a target's weights without reading them all: its shape, and a few rows of its
    embeddings, final norm and last layer rounded to bf16 (so the same weights saved in fp32 or
    bf16, or by another transformers version, give the same fingerprint)."""
    from safetensors import safe_open

    config = ModelConfig.from_dir(model_dir)
    shape = [config.model_type, config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers,
             config.num_heads, config.num_kv_heads, config.head_dim]
    digest = hashlib.sha256(json.dumps(shape).encode())
    wanted = ["embed_tokens.weight", "norm.weight", f"layers.{config.num_layers - 1}.mlp.down_proj.weight"]
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                short = name.removeprefix("model.")
                if short in wanted and short not in found:
                    found[short] = f.get_slice(name)[:4]
    for name in wanted:
        if name not in found:
            raise ValueError(f"{model_dir} has no tensor {name!r}: is it a Llama-family checkpoint?")
        digest.update(found[name].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def find_head(kind: str, source: str | None, target_dir: Path | None) -> Path:
    """A head's directory: `source` as a path, or (None) the shipped head of `kind` whose
    fingerprint matches the target's."""
    if source is not None:
        path = Path(source).expanduser()
        if not (path / CONFIG_FILE).exists():
            choices = ("a positive number of layers (early-exit:6, untrained), 'trained' (the shipped head)"
                       if kind == "early-exit" else "nothing (the shipped head)")
            raise FileNotFoundError(f"{kind}:{source}: no {CONFIG_FILE} in {source!r}; give {choices}, "
                                    "or the directory `specserve train-drafter --out` wrote")
        return path
    fingerprint = None if target_dir is None else target_fingerprint(target_dir)
    shipped = sorted(p.parent for p in SHIPPED_DIR.glob(f"*/{kind}/{CONFIG_FILE}"))
    for directory in shipped:
        if HeadConfig.load(directory).target_fingerprint == fingerprint:
            return directory
    names = ", ".join(HeadConfig.load(d).target for d in shipped) or "none"
    raise ValueError(f"no shipped {kind} head for this target (shipped: {names}): train one with "
                     f"`specserve train-drafter --kind {kind} --out DIR` and use {kind}:DIR")


class _SeqState:
    """A sequence's head cache and the target's hidden states it has not consumed yet."""

    def __init__(self) -> None:
        self.computed = 0  # leading rows whose head K/V are in place
        self.start = 0  # position of the first kept hidden state
        self.end = 0  # position after the last kept hidden state
        self.rows: list[torch.Tensor] = []

    def add(self, position: int, hidden: torch.Tensor) -> None:
        if not self.rows or position != self.end:  # the first, or after a gap: start afresh
            self.start, self.rows = position, []
        self.rows.append(hidden)
        self.end = position + len(hidden)

    def take(self, first: int, stop: int) -> torch.Tensor:
        """Hidden states of positions [first, stop); those before `stop - 1` are dropped."""
        if first < self.start or stop > self.end:
            raise RuntimeError(f"head state holds positions [{self.start}, {self.end}), asked for [{first}, {stop})")
        rows = torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0]
        keep = max(0, stop - 1 - self.start)
        self.start, self.rows = self.start + keep, [rows[keep:]]
        return rows[first - (self.start - keep): stop - (self.start - keep)]


class HeadDrafter(TreeSearchDrafter, OwnsKV, Observes):
    """What both head kinds share: the checkpoint, the one-layer cache, the draft vocabulary,
    and the per-sequence bookkeeping of hidden states."""

    kind: str
    shift: int  # row i reads the target's hidden state at position i - shift

    def __init__(self, source: str | None = None, top_k: int = 4, beam: int = 4):
        super().__init__(top_k, beam)
        self.source = source
        self.spec = self.kind if source is None else f"{self.kind}:{source}"
        self.target: LlamaForCausalLM | None = None
        self.config: HeadConfig | None = None
        self._seqs: dict[int, _SeqState] = {}

    # -- set-up ------------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int, target: ModelConfig, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_block(target, block_size, dtype) // target.num_layers

    def attach(self, target: DraftTarget) -> None:
        directory = find_head(self.kind, self.source, target.model_dir)
        config = HeadConfig.load(directory)
        model = target.runner.model
        if config.kind != self.kind:
            article = "an" if self.kind[0] in "aeiou" else "a"
            raise ValueError(f"{directory} holds a {config.kind} head, not {article} {self.kind} head: use "
                             f"{config.kind}:{directory}")
        if target.model_dir is not None and config.target_fingerprint != target_fingerprint(target.model_dir):
            raise ValueError(f"drafter head {directory} was trained for {config.target!r}, not the target this "
                             f"engine serves ({target.model_dir}): train one for it with `specserve train-drafter`")
        tensors = load_file(str(directory / WEIGHTS_FILE))
        device = target.runner.device  # the head lives where the target does
        self.vocab_ids = tensors.pop("vocab_ids").to(device=device, dtype=torch.int64)
        self.column_tokens = self.vocab_ids
        self.layer = build_layer(model.config, {k.removeprefix("layer."): v for k, v in tensors.items()
                                                if k.startswith("layer.")}, model.dtype, device)
        pack = packing_available(model.dtype, device)
        self.lm_head = model.lm_head.select_rows(self.vocab_ids)
        self._load_extra(tensors, model, pack)
        self.stack = self._quantize_like(model)
        mc = model.config
        self.cache = KVCache(1, target.num_blocks, target.block_size, mc.num_kv_heads, mc.head_dim, model.dtype,
                             device)
        self.target, self.config, self.vocab_size = model, config, target.vocab_size
        self.target_runner = target.runner

    def _load_extra(self, tensors: dict[str, torch.Tensor], model: LlamaForCausalLM, pack: bool) -> None:
        """Weights besides the layer (the feature head's fc)."""

    def _projections(self) -> list[Projection]:
        attention, mlp = self.layer.self_attn, self.layer.mlp
        return [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]

    def _quantize_like(self, model: LlamaForCausalLM) -> torch.ScriptObject | None:
        """Where the target runs in quantized blocks on a CPU (fp32 states), the head's projections
        too, in 8-bit blocks, and its layer as one C++ call: the plain fp32 layer read four times
        the bytes, op by op, and made a SmolLM2 feature head's round cost half a target decode.
        The target verifies every drafted token, so this changes which tokens are drafted, never
        what is emitted. Returns the layer's stack (None: the layer stays as loaded)."""
        target = model.layers[0]
        quantized = all(p.quantized for p in (target.self_attn.qkv_proj, target.mlp.down_proj))
        if not quantized or model.dtype != torch.float32 or self.layer.input_layernorm.weight.device.type != "cpu":
            return None
        for projection in self._projections():
            projection.requantize(HEAD_BITS)
        if os.environ.get("SPECSERVE_DECODER_STACK") == "0":  # module by module, as the target then runs
            return None
        return build_decoder_stack([self.layer], model.config)

    # -- hidden states -----------------------------------------------------------------------

    def hidden_wanted(self) -> tuple[int, ...]:
        return (self.config.layer,) if self.config is not None else ()

    def observe(self, commit: Commit) -> None:
        if self.config is not None and self.config.layer in commit.hidden:
            self._seqs.setdefault(commit.seq_id, _SeqState()).add(commit.position, commit.hidden[self.config.layer])

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _resume(self, search: _Search) -> tuple[int, _SeqState]:
        """The first row to recompute this step, and the hidden states its rows up to the root read."""
        length = len(search.request.token_ids)
        state = self._seqs.setdefault(search.request.seq_id, _SeqState())
        first = min(state.computed, length - 1)
        if not state.rows:
            raise RuntimeError(f"{self.spec}: no target hidden states for sequence {search.request.seq_id} "
                               "(the engine must pass them with observe())")
        if first or state.start:  # rows whose hidden state is gone: in prefix-cached blocks
            first = max(first, state.start + self.shift)
        state.computed = length
        return first, state

    # -- running the head --------------------------------------------------------------------

    def _run_layer(self, requests: list[TreeRequest], x: torch.Tensor) -> torch.Tensor:
        return self.target_runner.run_layer(self.layer, self.cache, requests, x, self.stack)

    def _score(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of head outputs over the draft vocabulary (`column_tokens`)."""
        return self.lm_head(normed).float()


class FeatureHeadDrafter(HeadDrafter):
    kind, shift = "feature", 1

    def _load_extra(self, tensors, model, pack) -> None:
        hidden = model.config.hidden_size
        self.fc = Projection(2 * hidden, [hidden])
        device = model.norm.weight.device
        self.fc.load([tensors["fc.weight"].to(device=device, dtype=model.dtype)],
                     [tensors["fc.bias"].to(device=device, dtype=model.dtype)], pack=pack)

    def _projections(self) -> list[Projection]:
        return [*super()._projections(), self.fc]

    @torch.inference_mode()
    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        requests, features, tokens, wanted = [], [], [], []
        for search in searches:
            request = search.request
            length = len(request.token_ids)
            if search.rounds == 0:  # catch up, ending at the root
                first, state = self._resume(search)
                inputs = state.take(max(first - 1, 0), length - 1)
                if first == 0:  # the first row has no feature before it
                    inputs = torch.cat([inputs.new_zeros(1, inputs.shape[1]), inputs])
                search.node_input = {0: inputs[-1]}
                nodes = [0]
                requests.append(search.catch_up(first))
                features.append(inputs)
                tokens.extend(request.token_ids[first:])
                wanted.append([len(inputs) - 1])
                search.forwarded = nodes
                continue
            tree, frontier = search.forward_tree()
            nodes = search.forward_nodes()
            parents = search.parents
            features.append(torch.stack([search.node_input[0] if n == 0 else search.node_state[parents[n]]
                                         for n in nodes]))
            requests.append(TreeRequest(tree, length - 1, request.block_table))
            tokens.extend(tree.tokens)
            wanted.append(frontier)
            search.forwarded = nodes
        embedded = self.target.embed_tokens(torch.tensor(tokens, dtype=torch.int64))
        x = self.fc(torch.cat([torch.cat(features).to(embedded.dtype), embedded], dim=-1))
        out = self._run_layer(requests, x)
        logits, start = [], 0
        for search, request, rows in zip(searches, requests, wanted, strict=True):
            mine = out[start: start + len(request.tree)]
            start += len(request.tree)
            offset = len(request.tree) - 1 if search.rounds == 0 else 0
            for index, node in enumerate(search.forwarded):
                search.node_state.setdefault(node, mine[index + offset])
            logits.append(self._score(mine[rows]))
        return logits


class EarlyExitHeadDrafter(HeadDrafter):
    kind, shift = "early-exit", 0

    def __init__(self, source: str | None = None, top_k: int = 4, beam: int = 4):
        super().__init__(source, top_k, beam)
        self.spec = f"early-exit:{source or 'trained'}"

    @torch.inference_mode()
    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        # The target's first K layers over each search's tree (round 0: the root alone).
        target_requests = []
        for search in searches:
            request = search.request
            if search.rounds == 0:
                tree, rows = TokenTree.single(request.token_ids[-1]), [0]
            else:
                tree, rows = search.forward_tree()
            target_requests.append(TreeRequest(tree, len(request.token_ids) - 1, request.block_table, rows))
        x = self.target_runner.run_layers(target_requests, self.config.layer)
        # The head layer: round 0 catches up on committed rows (the target's own states) first.
        head_requests, inputs, wanted, start = [], [], [], 0
        for search, target_request in zip(searches, target_requests, strict=True):
            mine = x[start: start + len(target_request.tree)]
            start += len(target_request.tree)
            request = search.request
            if search.rounds == 0:
                first, state = self._resume(search)
                length = len(request.token_ids)
                committed = state.take(first, length - 1) if first < length - 1 else mine[:0]
                inputs.append(torch.cat([committed.to(mine.dtype), mine]))
                head_requests.append(search.catch_up(first))
                wanted.append([len(committed)])
            else:
                inputs.append(mine)
                head_requests.append(target_request)
                wanted.append(list(target_request.logits))
        out = self._run_layer(head_requests, torch.cat(inputs))
        logits, start = [], 0
        for request, rows in zip(head_requests, wanted, strict=True):
            mine = out[start: start + len(request.tree)]
            start += len(request.tree)
            logits.append(self._score(self.target.norm(mine[rows])))
        return logits


def build_layer(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> DecoderLayer:
    """A decoder layer of the target's shape from Hugging Face-named tensors (K/V: layer 0 of its
    cache), on `device`."""
    from specserve.models.loader import Checkpoint, load_layer

    with torch.device("meta"):
        layer = DecoderLayer(config, 0)
    ckpt = Checkpoint(dict(tensors), dtype, Path("<head>"), device)
    load_layer(layer, ckpt, "", config, packing_available(dtype, device))
    if ckpt.tensors:
        raise ValueError(f"drafter head has tensors a decoder layer does not use: {sorted(ckpt.tensors)[:5]}")
    return layer.eval().requires_grad_(False)
