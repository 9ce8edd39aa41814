"""Quantized weights' tiles in memory backed by transparent huge pages (2 MiB), in the order a
forward reads them.

A decode step on a CPU streams every weight once: SmolLM2-135M's 98 MB are 24,000 pages of 4 KiB
a step, far more than the TLB holds, so nearly every page costs a page walk while the kernels
wait on the stream. One anonymous mapping advised MADV_HUGEPAGE needs 50. Measured on an AMD EPYC
(Zen 4), same process, steps alternating between the two copies of the model: decode 3% and an
8-node tree 4% faster than the same tiles in the prepared file's 4 KiB pages (and 4 KiB pages of
an anonymous mapping were no faster than the file's). The bits of every result are unchanged:
the kernels read the same bytes.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch import nn

from specserve.models.gguf import QuantizedRows
from specserve.models.linear import Projection, weights_changed

log = logging.getLogger(__name__)

HUGE_PAGE = 2**21
ALIGNMENT = 64  # each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        chosen = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in chosen or "[madvise]" in chosen


def tiled_weights(model: nn.Module) -> list[tuple[QuantizedRows, tuple[torch.Tensor, ...]]]:
    """Each quantized projection weight with CPU tiles, once, in module order (a forward's order)."""
    seen: set[int] = set()
    found = []
    for module in model.modules():
        if not isinstance(module, Projection):
            continue
        for weight in module.quantized:
            tiles = weight.tiles()
            if id(weight) in seen or tiles is None or any(t.device.type != "cpu" for t in tiles):
                continue
            seen.add(id(weight))
            found.append((weight, tiles))
    return found


def _span(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT


def move_tiles_to_huge_pages(model: nn.Module) -> int:
    """Copy every quantized projection's tiles into one anonymous mapping advised MADV_HUGEPAGE,
    laid out in forward order, and have the weights use the copies; returns the bytes moved (0
    where the kernel offers no transparent huge pages or nothing is tiled)."""
    weights = tiled_weights(model) if huge_pages_offered() else []
    total = sum(_span(t) for _, tiles in weights for t in tiles)
    if total == 0:
        return 0
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MiB pages
    except OSError as e:  # a kernel built without them: the tiles stay where they are
        log.debug("no huge pages for the weights: %s", e)
        mapping.close()
        return 0
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -arena.data_ptr() % HUGE_PAGE
    for weight, tiles in weights:
        copies = []
        for t in tiles:
            copy = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            copies.append(copy.copy_(t))
            offset += _span(t)
        weight.adopt_tiles(tuple(copies))
    model.huge_page_tiles = mapping  # the copies are views of it: it lives as long as the model
    weights_changed()
    log.debug("%d weights' tiles (%.1f MB) moved to huge pages", len(weights), total / 1e6)
    return total


def huge_page_bytes(model: nn.Module) -> int:
    """How many bytes of the model's tiles `move_tiles_to_huge_pages` moved (0: none)."""
    mapping = getattr(model, "huge_page_tiles", None)
    return 0 if mapping is None else len(mapping) - HUGE_PAGE
