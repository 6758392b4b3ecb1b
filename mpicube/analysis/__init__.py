"""Analysis: what a run costs and what it computed, measured and predicted.

``costmodel`` derives each layout's communication from its collective
sequence (over what ``costparams`` says each rank holds), ``costmemory`` its memory and ``costflops`` its FLOPs over the
``Problem`` of ``costbase``, ``costpipe`` a pipeline's point-to-point
traffic, bubble and in-flight activations from the schedule
(``costreport`` and ``costpipereport`` print them for ``mpicube info``),
``bench`` times steps and checks the counters against the model,
``trace`` records a run tensor by tensor by observing the trainer's step
(in the format of ``check``, which also compares two traces), and
``profile`` (with ``profile_summary`` and ``timeline``) writes, sums up and
draws per-rank timelines of compute and communication (``--profile``).

May import: every layer below the command line.
"""
