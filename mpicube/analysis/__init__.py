"""Analysis: what a run costs and what it computed, measured and predicted.

``costmodel`` derives each layout's communication, memory and FLOPs from
its collective sequence (``costreport`` prints them for ``mpicube info``),
``bench`` times steps and checks the counters against the model,
``trace`` records a run tensor by tensor by observing the trainer's step,
``compare`` finds the first divergence between two traces, and
``profile`` (with ``profile_summary`` and ``timeline``) writes, sums up and
draws per-rank timelines of compute and communication (``--profile``).

May import: every layer below the command line.
"""
