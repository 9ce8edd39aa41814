"""Quantized weights' tiles move into one mapping advised for huge pages, in the order a forward
reads them, and compute exactly what they computed before (`specserve.models.huge_pages`)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models import huge_pages
from specserve.models.loader import load_model
from specserve.tree import TokenTree


def madvise_hugepage_works() -> bool:
    """Whether this kernel takes MADV_HUGEPAGE at all (one built without huge pages refuses it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    probe = mmap.mmap(-1, huge_pages.HUGE_PAGE)
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    finally:
        probe.close()
    return True


needs_madvise = pytest.mark.skipif(not madvise_hugepage_works(), reason="this kernel refuses MADV_HUGEPAGE")


@pytest.fixture
def thp_setting(tmp_path, monkeypatch):
    """Factory: the kernel's transparent huge page setting as `text` says (a file in its place)."""

    def write(text: str | None):
        path = tmp_path / "enabled"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(huge_pages, "THP_SETTING", path)

    return write


@needs_madvise
@pytest.mark.parametrize(("text", "offered"), [
    ("always [madvise] never\n", True), ("[always] madvise never\n", True),
    ("always madvise [never]\n", False), (None, False),
])
def test_huge_pages_are_offered_where_the_kernel_grants_them_to_memory_that_asks(thp_setting, text, offered):
    thp_setting(text)
    assert huge_pages.huge_pages_offered() is offered


def logits(model) -> torch.Tensor:
    """A prompt, then a branching tree over it: every row's logits."""
    runner = ModelRunner(model, KVCache.for_model(model.config, 8, 4, torch.float32))
    gen = torch.Generator().manual_seed(3)
    prompt = TokenTree.chain(torch.randint(0, 400, (11,), generator=gen).tolist())
    tree = TokenTree(tuple(torch.randint(0, 400, (5,), generator=gen).tolist()), (-1, 0, 0, 1, 2))
    first = runner.forward([TreeRequest(prompt, 0, [0, 1, 2, 3], logits="all")])
    second = runner.forward([TreeRequest(tree, 11, [0, 1, 2, 3, 4], logits="all")])
    return torch.cat([first.logits, second.logits])


def mapping_range(address: int) -> tuple[int, int, str]:
    """The mapping of this process that holds `address`: its start, end and VmFlags."""
    start = end = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            start, end = (int(a, 16) for a in fields[0].split("-"))
        elif fields[0] == "VmFlags:" and start <= address < end:
            return start, end, line
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_madvise
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_tiles_move_in_forward_order_into_one_advised_mapping_and_compute_the_same(dummy_model, thp_setting,
                                                                                  quantization):
    path = dummy_model()
    thp_setting("always madvise [never]\n")
    model = load_model(path, quantization=quantization, load_format="dummy")
    weights = huge_pages.tiled_weights(model)
    if not weights:
        pytest.skip("this CPU's kernels take the weights untiled")
    assert huge_pages.huge_page_bytes(model) == 0  # not offered: left where they were
    with torch.inference_mode():
        before = logits(model)

    thp_setting("always [madvise] never\n")
    moved = huge_pages.move_tiles_to_huge_pages(model)

    tiles = [t for _, ts in huge_pages.tiled_weights(model) for t in ts]
    assert moved == huge_pages.huge_page_bytes(model) == sum(huge_pages._span(t) for t in tiles) > 0
    addresses = [t.data_ptr() for t in tiles]
    ends = [a + huge_pages._span(t) for a, t in zip(addresses, tiles, strict=True)]
    assert addresses[1:] == ends[:-1]  # back to back, each on a cache line, in forward order
    assert all(a % huge_pages.ALIGNMENT == 0 for a in addresses)
    assert addresses[0] % huge_pages.HUGE_PAGE == 0
    start, end, flags = mapping_range(addresses[0])
    assert end >= tiles[-1].data_ptr() + tiles[-1].numel() * tiles[-1].element_size()
    assert " hg" in flags  # advised MADV_HUGEPAGE
    with torch.inference_mode():
        assert torch.equal(logits(model), before)
