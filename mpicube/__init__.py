"""mpicube: tensor-parallel GPT training in pure array code over MPI.

Layers, bottom to top (DESIGN.md section 1): backend, comm, grid, layouts,
ops, model, optim/data/checkpoint, train/cli.
"""

__version__ = "0.1.0"
