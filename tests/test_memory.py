"""phasekv.memory: the one check of a memory budget (its callers' estimates are tested with them: test_families.py,
test_multiquery.py, test_reliability.py) and the memory it reads as free."""

import pytest

from phasekv import memory


def test_work_that_fits_passes_and_one_byte_more_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 3 * memory.GIB)
    memory.check_budget(3 * memory.GIB, "train: a micro-batch")  # exactly what is free: it fits
    with pytest.raises(ValueError) as refused:
        memory.check_budget(3 * memory.GIB + 1, "train: a micro-batch", bound="at least", advice="lower it")
    assert str(refused.value) == ("train: a micro-batch: needs at least 3.0 GiB, only 3.0 GiB of memory is "
                                  "available; lower it")


def test_a_given_budget_replaces_the_memory_free_now(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 62)
    with pytest.raises(ValueError, match=r"^model: needs about 2\.0 GiB, only 1\.0 GiB of memory is available$"):
        memory.check_budget(2 * memory.GIB, "model", have=memory.GIB)
    monkeypatch.setattr(memory, "available_memory", lambda: 0)
    memory.check_budget(memory.GIB, "model", have=memory.GIB)


def test_the_cpu_budget_is_what_the_system_reports_available():
    have, budget = memory.free_memory("cpu")
    assert have == memory.available_memory() and budget == "of memory is available"
    with open("/proc/meminfo") as f:
        reported = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(have - reported) < memory.GIB  # read a moment apart


def test_an_unavailable_device_is_named():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        memory.check_budget(1, "context", device="cuda")
