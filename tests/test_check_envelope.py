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
