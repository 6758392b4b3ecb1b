"""The learning-rate schedule against its documented formula, at the steps
where it changes shape (docs/trace-format.md, "The optimizer attribute"):

    lr(s) = peak * s / warmup                                   s <= warmup
    lr(s) = min_lr + (peak - min_lr) (1 + cos(pi * min(1, (s - warmup) / max(1, steps - warmup)))) / 2

with min_lr = 0.1 * peak. The expected values below are written out by
hand from that formula (not by calling it), at the boundary steps: the
first step, the last warmup step, the first cosine step, the middle of the
decay, the last step and past it. The trace's reader (mpicube.check) must
give the same numbers from the trace's own description of the schedule.
"""

import math

import pytest

from mpicube.check.reference import lr_at
from mpicube.training.optim import Schedule

PEAK = 3e-3
FLOOR = 3e-4


@pytest.mark.parametrize("warmup, steps, expected", [
    # warmup 4 of 12: a ramp of PEAK/4 per step, then cosine over the 8 steps after it
    (4, 12, {1: PEAK / 4, 3: 3 * PEAK / 4, 4: PEAK,
             5: FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi / 8)) / 2,
             8: FLOOR + (PEAK - FLOOR) / 2,                           # half way: cos(pi/2) = 0
             11: FLOOR + (PEAK - FLOOR) * (1 + math.cos(7 * math.pi / 8)) / 2,
             12: FLOOR, 13: FLOOR, 100: FLOOR}),                      # held at the floor past the end
    # no warmup: the cosine starts at step 0 (PEAK) and step 1 is already on it
    (0, 4, {1: FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi / 4)) / 2, 2: FLOOR + (PEAK - FLOOR) / 2,
            4: FLOOR}),
    # warmup as long as the run: a ramp to PEAK at the last step, the floor after it (span max(1, 0) = 1)
    (3, 3, {1: PEAK / 3, 2: 2 * PEAK / 3, 3: PEAK, 4: FLOOR}),
    # a one-step run with one warmup step
    (1, 1, {1: PEAK, 2: FLOOR}),
])
def test_schedule_matches_the_documented_formula_at_its_boundaries(warmup, steps, expected):
    schedule = Schedule(PEAK, warmup, steps)
    described = {"peak": PEAK, "warmup": warmup, "steps": steps, "min_lr": FLOOR}
    for s, lr in expected.items():
        assert schedule(s) == pytest.approx(lr, rel=1e-14, abs=1e-18), (warmup, steps, s)
        assert lr_at(described, s) == pytest.approx(lr, rel=1e-14, abs=1e-18), (warmup, steps, s)


def test_the_schedule_is_continuous_where_warmup_hands_over_to_the_cosine():
    schedule = Schedule(PEAK, 10, 1000)
    assert schedule(10) == PEAK and PEAK - schedule(11) < PEAK * 1e-4      # no jump at the hand-over
    assert all(schedule(s) >= schedule(s + 1) for s in range(10, 1001))   # non-increasing after warmup
