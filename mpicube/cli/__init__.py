"""The command line: one module per command group, and generation.

``main`` is the console entry point (``mpicube``, ``python -m mpicube``);
``common`` holds the group and the options commands share; ``train``
(train, eval, prepare, trace) and ``model`` (info, bench, inspect, convert,
generate, compare) and ``pictures`` (timeline, plot) hold the commands;
``sections`` lays out a long ``--help`` in sections; ``generate`` samples text from a
model with the KV cache. Commands parse options, then hand over to the
layers below; they hold no training or model logic of their own.

May import: every layer below (``core`` to ``analysis``).
"""
