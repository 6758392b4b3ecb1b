"""Run on CI's CuPy stand-in: device-to-host transfers per serial training step.

A GPU step may copy to the host only the loss and the gradient norm; every
other copy is a synchronisation that stalls the device. This counts them on
the real training loop (``Trainer.train_step``) for each depth given on
the command line and prints one JSON object: {n_layer: [transfers of steps 2, 3, 4]}.

Usage: PYTHONPATH=tests/fake_gpu:. python tests/gpu_transfers_check.py RUN_DIR 2 6
"""

import json
import sys

import cupy

from mpicube.training.train import Trainer, TrainOptions


def transfers_per_step(run_dir: str, n_layer: int) -> list:
    opts = TrainOptions(layout="serial", n_layer=n_layer, n_head=2, n_embd=16, seq_len=16, batch_size=4,
                        steps=4, dropout=0.1, device="gpu", out=f"{run_dir}/layers{n_layer}")
    trainer = Trainer(opts)
    trainer.setup()
    counts = []
    for step in range(1, opts.steps + 1):
        cupy._stand_in.reset_transfers()
        trainer.train_step(step)
        counts.append(cupy._stand_in.transfers()["d2h"])
    return counts[1:]                        # the first step also builds caches


if __name__ == "__main__":
    run_dir, depths = sys.argv[1], [int(a) for a in sys.argv[2:]]
    print(json.dumps({n: transfers_per_step(run_dir, n) for n in depths}))
