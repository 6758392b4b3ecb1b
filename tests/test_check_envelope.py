"""Measured tolerances (check/envelope.py): the two statistics, and
``--tolerance envelope`` without an envelope as bad input. The
demonstration on real traces - a bfloat16 candidate passing, a 1%
gradient error failing the envelope and passing the depth bound - is in
tests/test_planted_bugs.py, from the catalogue's launch."""

import numpy as np
from test_check import good, run  # noqa: F401 - fixtures

from mpicube.check import envelope


def test_the_scale_finds_a_one_percent_error_that_noise_of_its_size_hides():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1024)
    noise = a + 0.006 * np.linalg.norm(a) / 32 * rng.standard_normal(1024)      # rel fro about 6e-3
    scaled = a * 1.01
    (rel_noise, scale_noise), (rel_scaled, scale_scaled) = envelope.statistics(a, noise), envelope.statistics(a, scaled)
    assert 0.4 < rel_scaled / rel_noise < 3                                        # the sizes do not tell them apart
    assert abs(scale_scaled - 0.01) < 1e-12 and scale_noise < 1e-3                 # the scale does


def test_envelope_without_an_envelope_is_bad_input(good, capsys):
    status, _, err, _ = run(capsys, good, good, "--tolerance", "envelope")
    assert status == 2 and "--tolerance envelope: neither trace holds an envelope" in err


def test_fp8_codes_may_lie_one_step_from_the_reference_and_no_further():
    """Under the envelope an FP8 weight's codes (sign bit, magnitude code)
    and MXFP8's E8M0 scale bytes may each sit one step from the
    reference's, a value at a rounding boundary of the grid; two steps, or
    a sign flipped on anything but the smallest values, fail."""
    from mpicube.check.measure import Row

    def judged(a, b, name="step_2/fp8/h.0.mlp.c_fc/w.forward/bytes"):
        a, b = np.asarray(a, np.uint8), np.asarray(b, np.uint8)
        row = Row(name, a.shape, 1.0, 1.0, False)
        envelope.codes(row, name, [lambda block: a[block], lambda block: b[block]], a.shape)
        return row

    ref = [[0x45, 0xC5, 0x00, 0x7E]]
    assert judged(ref, ref).ok and judged(ref, ref).note == ""
    row = judged(ref, [[0x46, 0xC4, 0x80, 0x7E]])          # +1, -1 in magnitude, +0 vs -0
    assert row.ok and row.note == "2 of 4 codes one FP8 step apart (a rounding boundary)", row.note
    assert judged([[0x00]], [[0x81]]).ok                    # the smallest values either side of zero
    row = judged(ref, [[0x45, 0xC5, 0x00, 0x7C]])
    assert not row.ok and row.note == "codes more than one FP8 step apart, first at (0, 3): 126 vs 124", row.note
    assert not judged([[0x01]], [[0x81]]).ok                # a sign flip of a non-zero value
    dy = "step_1/fp8/h.0.attn.c_attn/dy.dgrad/bytes"       # a gradient's subnormals: noise around a zero
    assert judged([[0x00, 0x83]], [[0x03, 0x01]], dy).ok and not judged([[0x00]], [[0x03]]).ok
    assert not judged([[0x00]], [[0x04]], dy).ok and not judged([[0x01]], [[0x85]], dy).ok
    scale = "step_1/fp8/h.0.mlp.c_fc/w.forward/scale"       # E8M0 exponents: one code is a factor 2
    assert judged([[127, 130]], [[128, 130]], scale).ok and not judged([[127]], [[129]], scale).ok
