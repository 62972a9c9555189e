"""Placement: packing, exclusivity, memory limits, multi-device requests, never-fits, tags; inventory configs."""

from __future__ import annotations

import random

import pytest

from tinker_pipelines.scheduler import Allocation, Device, Inventory, StepNeeds, check_fits, needs_from_tags, place
from tinker_pipelines.scheduler.placement import device_use, granted_needs, reserve, starving


def inv(*memory: float) -> Inventory:
    return Inventory.from_config({"devices": [{"memory_gb": m} for m in memory]})


def lora(gb: float, devices: int = 1) -> StepNeeds:
    return StepNeeds(devices, gb, "lora")


def excl(devices: int = 1, gb: float = 0.0) -> StepNeeds:
    return StepNeeds(devices, gb, "exclusive")


def grant(needs: StepNeeds, inventory: Inventory, leases: list[Allocation]) -> tuple[int, ...] | None:
    got = place(needs, inventory, leases)
    if got is not None:
        leases.append(Allocation(got, needs))
    return got


def test_lora_steps_pack_onto_one_device_before_opening_another():
    inventory, leases = inv(80, 80, 80), []
    assert [grant(lora(20), inventory, leases) for _ in range(4)] == [(0,)] * 4
    assert grant(lora(20), inventory, leases) == (1,)  # device 0 is full: open the next one
    assert grant(lora(60), inventory, leases) == (1,)  # 20 + 60 = 80 still fits on device 1
    assert grant(excl(), inventory, leases) == (2,)  # a whole device stayed free for it


def test_best_fit_picks_the_shared_device_with_least_free_memory():
    inventory = inv(80, 80, 80)
    leases = [Allocation((0,), lora(30)), Allocation((1,), lora(60)), Allocation((2,), lora(10))]
    assert place(lora(15), inventory, leases) == (1,)  # 20 GB free: the tightest fit
    assert place(lora(25), inventory, leases) == (0,)  # only 0 (50 free) and 2 (70 free) fit: 0 is tighter
    assert place(lora(75), inventory, leases) is None  # no shared device has 75 free, none is idle


def test_lora_opens_the_tightest_idle_device_only_when_no_shared_one_fits():
    inventory = inv(80, 40, 80)
    leases = [Allocation((0,), lora(70))]
    assert place(lora(30), inventory, leases) == (1,)  # 40 GB idle device is the best idle fit
    assert place(lora(50), inventory, leases) == (2,)  # too big for device 1


def test_exclusive_takes_only_idle_devices_and_nobody_joins_it():
    inventory, leases = inv(80, 80), [Allocation((0,), lora(10))]
    assert grant(excl(), inventory, leases) == (1,)
    assert place(excl(), inventory, leases) is None  # device 0 holds a lora step
    assert place(lora(10), inventory, leases) == (0,)  # fits beside the other lora step
    leases = [Allocation((0,), excl())]
    assert place(lora(1), inv(80), leases) is None  # never joins an exclusive holder


def test_exclusive_prefers_the_smallest_idle_device_that_is_large_enough():
    inventory = inv(80, 40, 24)
    assert place(excl(1, 30), inventory, []) == (1,)
    assert place(excl(1), inventory, []) == (2,)
    assert place(excl(2, 30), inventory, []) == (0, 1)
    assert place(excl(1, 30), inventory, [Allocation((1,), excl())]) == (0,)


def test_memory_is_never_over_subscribed_including_float_sums():
    inventory, leases = inv(1.0), []
    for _ in range(10):
        assert grant(lora(0.1), inventory, leases) == (0,)  # ten 0.1s sum to 0.9999999999999999
    assert place(lora(0.1), inventory, leases) is None
    assert place(lora(0.01), inventory, leases) is None


def test_multi_device_requests_get_distinct_devices_or_wait():
    inventory = inv(80, 80, 80, 80)
    leases = [Allocation((0,), lora(70)), Allocation((1,), excl())]
    assert place(lora(20, devices=2), inventory, leases) == (2, 3)
    assert place(lora(10, devices=3), inventory, leases) == (0, 2, 3)
    assert place(excl(2), inventory, leases) == (2, 3)
    assert place(excl(3), inventory, leases) is None  # fits the inventory, but must wait


def test_random_placements_never_oversubscribe_or_mix_exclusive():
    rng = random.Random(0)
    inventory = inv(80, 80, 40, 24)
    leases: list[Allocation] = []
    for _ in range(2000):
        if leases and rng.random() < 0.45:
            leases.pop(rng.randrange(len(leases)))
            continue
        if rng.random() < 0.3:
            needs = excl(rng.choice([1, 1, 2, 3]), rng.choice([0, 30, 60]))
        else:
            needs = lora(rng.choice([5, 10, 20, 30, 45]), rng.choice([1, 1, 1, 2]))
        got = grant(needs, inventory, leases)
        if got is not None:
            assert len(set(got)) == needs.devices
        for d, use in zip(inventory, device_use(inventory, leases)):
            assert use.reserved_gb <= d.memory_gb + 1e-9
            assert use.exclusive == 0 or use.tenants == 1


@pytest.mark.parametrize("needs, message", [
    (excl(3), "only 2 device"),
    (lora(10, devices=3), "only 2 device"),
    (lora(90), "largest device has 80 GB"),
    (excl(1, 100), "largest device has 80 GB"),
    (lora(50, devices=2), "only 1 of the 2 devices have >= 50 GB"),
])
def test_check_fits_rejects_what_can_never_be_placed(needs, message):
    with pytest.raises(ValueError, match=message):
        check_fits(needs, inv(80, 40))


def test_check_fits_accepts_what_only_has_to_wait():
    inventory = inv(80, 40)
    for needs in (excl(2), lora(80), lora(40, devices=2), excl(1, 80)):
        check_fits(needs, inventory)
    assert place(excl(2), inventory, [Allocation((0,), lora(1))]) is None


def test_tags_parse_with_defaults():
    assert needs_from_tags({"other": "x", "dagster/priority": "1"}) is None
    assert needs_from_tags({"tinker/sharing": "exclusive"}) == StepNeeds(1, 0.0, "exclusive")
    assert needs_from_tags({"tinker/devices": "2"}) == StepNeeds(2, 0.0, "exclusive")
    assert needs_from_tags({"tinker/sharing": " LoRA ", "tinker/memory_gb": "20.5"}) == StepNeeds(1, 20.5, "lora")
    assert needs_from_tags({"sched/devices": "4"}, prefix="sched/") == StepNeeds(4, 0.0, "exclusive")


@pytest.mark.parametrize("tags, message", [
    ({"tinker/gpus": "1"}, "unknown scheduler tag 'tinker/gpus'"),
    ({"tinker/devices": "two"}, "tinker/devices must be a positive integer, got 'two'"),
    ({"tinker/devices": "0"}, "tinker/devices must be a positive integer"),
    ({"tinker/devices": "1.5"}, "tinker/devices must be a positive integer"),
    ({"tinker/memory_gb": "lots"}, "tinker/memory_gb must be a non-negative number, got 'lots'"),
    ({"tinker/memory_gb": "nan"}, "tinker/memory_gb must be a non-negative number"),
    ({"tinker/memory_gb": "-4"}, "tinker/memory_gb must be a non-negative number"),
    ({"tinker/sharing": "shared"}, "tinker/sharing must be one of lora, exclusive, got 'shared'"),
    ({"tinker/sharing": "lora"}, "tinker/memory_gb .* is required"),
])
def test_bad_tags_name_the_tag(tags, message):
    with pytest.raises(ValueError, match=message):
        needs_from_tags(tags)


def test_step_needs_validate():
    for bad in (dict(devices=0), dict(devices=True), dict(memory_gb=-1), dict(sharing="gpu"),
                dict(sharing="lora", memory_gb=0)):
        with pytest.raises(ValueError):
            StepNeeds(**bad)


def test_lease_on_a_device_outside_the_inventory_is_an_error():
    with pytest.raises(ValueError, match="inventory has devices 0..0"):
        place(lora(1), inv(80), [Allocation((3,), lora(1))])


def test_starving_after_the_threshold_only():
    assert not starving(95.0, 100.0, 10.0)
    assert starving(80.0, 100.0, 10.0)
    assert not starving(0.0, 100.0, None)


def test_reserve_holds_back_the_devices_a_starving_request_can_use_soonest():
    inventory = inv(80, 80, 80, 40)
    leases = [Allocation((0,), lora(20)), Allocation((0,), lora(20)), Allocation((1,), lora(70)),
              Allocation((2,), lora(10))]
    assert reserve(excl(2), inventory, leases) == (2, 3)  # idle device 3, then the one with one small tenant
    assert reserve(excl(2, 60), inventory, leases) == (1, 2)  # device 3 is too small; 1 tenant drains before 2
    assert reserve(lora(75), inventory, leases) == (2,)  # the most free memory: closest to fitting
    assert reserve(lora(30, devices=2), inventory, [Allocation((3,), excl())] + leases) == (0, 2)


def test_younger_requests_are_placed_around_a_reservation():
    inventory = inv(80, 80, 80)
    leases = [Allocation((0,), lora(20)), Allocation((1,), lora(20))]
    assert place(lora(20), inventory, leases) == (0,)
    assert place(lora(20), inventory, leases, exclude=(0,)) == (1,)
    assert place(lora(20), inventory, leases, exclude=(0, 1)) == (2,)
    assert place(excl(), inventory, leases, exclude=(2,)) is None
    assert place(lora(20, devices=2), inventory, leases, exclude=(1,)) == (0, 2)


def based(base: str, gb: float, resident_gb: float) -> StepNeeds:
    return StepNeeds(1, gb, "lora", base, resident_gb)


def test_new_bases_spread_over_idle_devices_and_steps_join_their_bases_worker():
    inventory, leases, resident = inv(80, 80, 80, 80), [], {}
    for base in "ABCD":  # each brings its own copy: one per idle device, not stacked on device 0
        got = place(based(base, 20, 4), inventory, leases, resident=resident)
        leases.append(Allocation(got, based(base, 20, 4)))
        resident.setdefault(got[0], set()).add(base)
    assert sorted(d for (d,) in (a.devices for a in leases)) == [0, 1, 2, 3]
    for base in "ABCD":  # a second step of each base goes to its worker, at the resident cost
        needs = based(base, 20, 4)
        got = place(needs, inventory, leases, resident=resident)
        assert base in resident[got[0]]
        assert granted_needs(needs, got, resident).memory_gb == 4
    # without a base (an explicit memory tag) packing is best-fit as before
    assert place(lora(20), inventory, leases) == (0,)


def test_spreading_stops_where_exclusive_steps_need_the_idle_devices():
    inventory, leases = inv(80, 80, 80, 80), [Allocation((0,), based("A", 20, 4))]
    assert place(based("B", 20, 4), inventory, leases) == (1,)  # 3 idle devices, none kept back
    assert place(based("B", 20, 4), inventory, leases, keep_idle=2) == (1,)  # 3 - 1 >= 2: still spreads
    assert place(based("B", 20, 4), inventory, leases, keep_idle=3) == (0,)  # would leave 2 < 3: packs
    assert place(based("B", 20, 4), inventory, [Allocation((0,), lora(70))], keep_idle=3) == (1,)  # 0 is full


def test_a_step_never_goes_where_its_cost_there_does_not_fit():
    inventory = inv(80, 24)
    leases = [Allocation((0,), lora(70)), Allocation((1,), lora(10))]
    assert place(based("A", 20, 8), inventory, leases, resident={0: {"A"}}) == (0,)  # 8 <= 10 free
    assert place(based("A", 20, 12), inventory, leases, resident={0: {"A"}}) is None  # 12 > 10, 20 > 14
    assert place(based("A", 14, 12), inventory, leases, resident={0: {"A"}}) == (1,)  # full copy fits on 1
    assert granted_needs(based("A", 14, 12), (1,), {0: {"A"}}).memory_gb == 14
    with pytest.raises(ValueError, match="resident_gb must be a number in"):
        based("A", 10, 12)


def test_check_fits_says_the_estimate_when_no_device_holds_it():
    from tinker_pipelines.scheduler.estimate import MemoryEstimate

    est = MemoryEstimate(16.06, 1.2, 0.9, 0.25)
    with pytest.raises(ValueError, match=r"^step needs 18\.4 GB \(weights 16\.1, KV 1\.2, activations 0\.9, "
                                         r"adapter 0\.2\) on one device, but the largest device has 16 GB"):
        check_fits(lora(round(est.total_gb, 3)), inv(16, 16), est)
    with pytest.raises(ValueError, match="only 2 device"):
        check_fits(lora(1, devices=3), inv(16, 16), est)


def test_inventory_from_config_forms():
    two = Inventory.from_config({"count": 2, "memory_gb": 80})
    assert [(d.index, d.kind, d.memory_gb) for d in two] == [(0, "sim", 80.0), (1, "sim", 80.0)]
    mixed = Inventory.from_config({"devices": [{"memory_gb": 80, "name": "a"}, {"memory_gb": 40}]})
    assert [(d.name, d.memory_gb) for d in mixed] == [("a", 80.0), ("sim1", 40.0)]


@pytest.mark.parametrize("config, message", [
    ({"devices": [{"memory_gb": 80}, {"memory_gb": "x"}]},
     r"^scheduler.inventory.devices\[1\].memory_gb must be a positive number, got 'x'$"),
    ({"devices": [{"memory_gb": 0}]}, r"devices\[0\].memory_gb must be a positive number"),
    ({"devices": [{"memory_gb": True}]}, r"devices\[0\].memory_gb must be a positive number"),
    ({"devices": [{}]}, r"devices\[0\].memory_gb is required"),
    ({"devices": [{"memory_gb": 8, "mem": 1}]}, r"devices\[0\].mem is not a known field"),
    ({"devices": []}, "devices must be a non-empty list"),
    ({"count": 0, "memory_gb": 80}, "count must be a positive integer, got 0"),
    ({"count": "2", "memory_gb": 80}, "count must be a positive integer"),
    ({"count": 2}, "memory_gb is required"),
    ({"count": 2, "memory_gb": 80, "extra": 1}, "scheduler.inventory.extra is not a known field"),
    ({"gpus": 2}, "needs either 'devices'"),
    ([80, 80], "must be a mapping"),
])
def test_inventory_config_errors_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        Inventory.from_config(config)


def test_inventory_detect_without_cuda_is_one_cpu_device():
    import torch

    detected = Inventory.detect()
    if torch.cuda.is_available():
        assert all(d.kind == "cuda" and d.memory_gb > 0 for d in detected)
    else:
        assert len(detected) == 1 and detected[0].kind == "cpu" and detected[0].memory_gb > 0.1


def test_inventory_rejects_bad_indices():
    with pytest.raises(ValueError, match="indices must be 0..n-1"):
        Inventory((Device(1, "sim", 80.0, "x"),))
    with pytest.raises(ValueError, match="kind must be one of"):
        Device(0, "tpu", 80.0, "x")
