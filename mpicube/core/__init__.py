"""The ground floor: what every layer needs and nothing depends on.

The error types and their exit statuses (``errors``), the model's sizes
(``config.ModelConfig``) and the rotary scalings it may hold (Llama 3's,
YaRN's: ``rope_scaling``), integer helpers for divisibility messages
(``intmath``), the memory a model needs against what the process may
still take (``memory``) and rank 0's console (``console``).

May import: nothing of mpicube (the standard library only: no NumPy
arrays, no MPI).
"""
