"""The mpicube command line with a pipeline fault planted from outside the
package (tests/test_pipeline.py); the package carries no test hook.

    mpiexec -n 2 python tests/pipeline_faults.py swap train --pp 2 ...
    mpiexec -n 2 python tests/pipeline_faults.py raise:1 train --pp 2 ...

``swap``: stage 0 runs its schedule with the first send_act moved after
the first recv_grad, an order that cannot complete: stage 1 waits for an
activation that stage 0 sends only after a gradient that stage 1 cannot
produce. The run must hang-fail (the watchdog, --collective-timeout).

``raise:S``: stage S raises in the backward of micro-batch 1 of step 2,
while the other stages wait in a receive; the whole job must end.
"""

import sys

from mpicube.training import pipeline

FAULT = sys.argv.pop(1)
_init = pipeline.Pipeline.__init__
_run = pipeline.GPT.backward


def planted(actions):
    actions = list(actions)
    moved = actions.pop(next(i for i, a in enumerate(actions) if a.op == "send_act"))
    recv = next(i for i, a in enumerate(actions) if a.op == "recv_grad")
    actions.insert(recv + 1, moved)
    return actions


def _planted_init(self, cfg, layout, store, **kwargs):
    _init(self, cfg, layout, store, **kwargs)
    if FAULT == "swap" and self.stage == 0:
        self.actions = planted(self.actions)
    if FAULT.startswith("raise:") and self.stage == int(FAULT.split(":")[1]):
        for v in range(self.V):
            model = self.chunk_model(v, 1)
            model.backward = lambda *a, model=model, **k: _fail(model, *a, **k)


def _fail(model, *args, **kwargs):
    if model.steps_seen >= 1:
        raise RuntimeError("planted failure in a pipeline stage's backward")
    model.steps_seen += 1
    return _run(model, *args, **kwargs)


pipeline.GPT.steps_seen = 0
pipeline.Pipeline.__init__ = _planted_init

if __name__ == "__main__":
    from mpicube.cli.main import main

    main(sys.argv[1:])
