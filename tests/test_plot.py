"""``mpicube plot``: loss curves of several runs in one PNG (analysis/curves.py)."""

import json

import numpy as np
import pytest
from conftest import TINY
from test_formats import run_cases

from mpicube.analysis.curves import moving_average, read_run

pytest.importorskip("matplotlib")


def test_plot_overlays_runs_and_a_mixtures_expert_load(tmp_path, tiny_shard):
    train = ["train", *TINY, "--data", tiny_shard, "--steps", "6", "--eval-every", "3"]
    cases = [[*train, "--out", "dense"],
             [*train, "--arch", "mixtral", "--n-experts", "4", "--out", "moe"],
             ["plot", "dense", "moe", "--out", "pics/both.png"],
             ["plot", "dense", "--out", "dense.png"],
             ["plot", "nowhere", "--out", "no.png"]]
    res = run_cases(tmp_path, cases)
    assert [r["status"] for r in res] == [0, 0, 0, 0, 2], res
    assert res[2]["out"][-1] == "wrote pics/both.png: 2 run(s), 12 training and 4 validation losses, expert load"
    assert res[3]["out"][-1] == "wrote dense.png: 1 run(s), 6 training and 2 validation losses"
    assert "nowhere: no metrics.jsonl" in res[4]["err"][-1] and not (tmp_path / "no.png").exists()
    import matplotlib.image

    both, dense = (matplotlib.image.imread(tmp_path / p) for p in ("pics/both.png", "dense.png"))
    assert both.shape[0] > dense.shape[0] > 100 and both.shape[1] == dense.shape[1]     # a second panel: load
    assert np.std(both[..., :3]) > 0.05                                                  # not a blank page

    run = read_run(tmp_path / "moe")
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    first = np.asarray(next(r for r in records if "expert_tokens" in r)["expert_tokens"], dtype=float)
    assert run["steps"] == list(range(1, 7)) and run["val_steps"] == [3, 6]
    assert run["load"][0] == (first.max(axis=1) / first.mean(axis=1)).max() >= 1


def test_moving_average_is_the_mean_of_the_window():
    assert moving_average([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([5.0], 3).tolist() == [5.0]
