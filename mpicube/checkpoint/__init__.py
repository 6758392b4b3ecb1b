"""HDF5 checkpoints written in parallel, read by anyone (DESIGN.md section 6).

A checkpoint is a directory ``RUN/ckpt/step_%08d/``::

    checkpoint.h5            the only file a reader opens
    shards/rank_00000.h5     one file per rank that wrote something
    shards/rank_00003.h5     ...

Every rank holds *blocks* of logical tensors.  A block is described by one
global index array per dimension (a block need not be contiguous: the column
block of ``c_attn.weight`` is three runs, one in each of q, k, v), and index
values at or past the logical shape are padding (vocabulary padding) and are
never stored.  Replicas of a block are written once, by the replica with
``writer=True``.

``save`` is collective.  Each writer rank writes the non-padding part of its
blocks into its own shard file (plain h5py, chunked, fletcher32) and hashes
the file (sha256).  Rank 0 gathers the metadata and writes ``checkpoint.h5``:
root attributes (``format``, ``version``, ``step``, the caller's ``attrs``,
``tensors`` = JSON list of names, ``shard_sha256`` = JSON {file: digest}) and,
for every tensor, an HDF5 *virtual dataset* of the full logical shape whose
pieces map onto the shard datasets through relative paths, so the directory
can be moved and plain ``h5py`` sees whole tensors::

    with h5py.File("RUN/ckpt/step_00001000/checkpoint.h5") as f:
        wte = f["model/wte"][...]          # (V, h), real vocabulary only

Commit is atomic: everything goes to ``RUN/ckpt/.tmp_step_%08d_<random>/``,
rank 0 checks it (coverage of every tensor by exactly one writer, every
source file and dataset present with the size its writer reported), renames
it to ``step_%08d`` and only then rewrites ``RUN/ckpt/latest`` (via a
temporary file and ``os.replace``).  A failure on any rank is agreed on by
all ranks, the temporary directory is removed and every rank raises
:class:`CheckpointError`; the previous checkpoint and ``latest`` are untouched.

Loading verifies, because a missing virtual-dataset source silently reads as
fill values: :func:`open_checkpoint` checks the format/version attributes and
the presence and sha256 digest of every shard.  Hashing reads every byte of
the checkpoint once per call; that is acceptable at the sizes mpicube trains,
and when many ranks load the same checkpoint, let one rank verify
(``verify=True``) and the others open with ``verify=False`` after a barrier.
"""
from .format import FORMAT, VERSION, Block, CheckpointError
from .report import inspect
from .read import Checkpoint, latest, open_checkpoint
from .write import save

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "Block", "Checkpoint",
    "save", "latest", "open_checkpoint", "inspect",
]
