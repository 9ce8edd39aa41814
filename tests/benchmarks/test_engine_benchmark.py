"""benchmarks/engine.py's helpers that decide what a measurement means."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import import_benchmark

engine = import_benchmark("engine")
cpu_ticks, steal_share = engine.cpu_ticks, engine.steal_share


def test_steal_share_is_the_stolen_part_of_all_cpu_time_between_two_readings():
    #         user nice system idle iowait irq softirq steal
    before = [1000, 0, 100, 5000, 0, 0, 0, 10]
    after = [1090, 0, 110, 5000, 0, 0, 0, 50]  # 140 ticks went by, 40 of them stolen
    assert steal_share(before, after) == 40 / 140


def test_steal_share_is_zero_without_counters_or_time():
    assert steal_share([], []) == 0.0
    assert steal_share([1] * 8, [1] * 8) == 0.0


def test_cpu_ticks_reads_the_steal_column_where_there_is_proc():
    ticks = cpu_ticks()
    if Path("/proc/stat").exists():
        assert len(ticks) > 7 and all(t >= 0 for t in ticks)
    else:
        assert ticks == []
