"""Training: the one training step and the run around it.

``train`` is the trainer (the only training step, observed through its
hooks), ``options`` its validated settings, ``parts`` builds the backend,
grid, layout, store and model; ``accum`` runs the micro-batches of one
step (``pipeline`` runs them through pipeline stages by a schedule), ``step`` and ``optim`` the gradient sums, norm and AdamW,
``loss_scale`` float16's dynamic scaling; ``stopping`` agrees on early
stops, ``rundir`` owns the run directory and its lock, ``dataplan`` which
rows each rank reads, ``state`` what a checkpoint holds, ``evaluate`` the
validation loss.

May import: ``core``, ``device``, ``ops``, ``parallel``, ``model``, ``files``, ``check``.
"""
