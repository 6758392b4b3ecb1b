"""HDF5 checkpoints written in parallel, read by anyone (docs/design.md section 6).

A checkpoint is a directory ``RUN/ckpt/step_%08d/``::

    checkpoint.h5            the only file a reader opens
    shards/rank_00000.h5     one file per rank that wrote something: the data
    shards/rank_00003.h5     ...
    index/rank_00000.h5      one file per rank that owns tensors: their pieces

Every rank holds *blocks* of logical tensors.  A block is described by one
global index array per dimension (a block need not be contiguous: the column
block of ``c_attn.weight`` is three runs, one in each of q, k, v), and index
values at or past the logical shape are padding (vocabulary padding) and are
never stored.  Replicas of a block are written once, by the replica with
``writer=True``.

``save`` is collective.  Each writer rank writes the non-padding part of its
blocks into its own shard file (plain h5py, chunked, fletcher32), checks it
and hashes it (sha256).  Every tensor has an *owner* rank (a hash of its
name): the ranks send each owner the metadata of its tensors' blocks, and
the owner checks that every element has exactly one writer and writes, in
``index/rank_XXXXX.h5``, a virtual dataset per tensor with one mapping per
stored block.  Rank 0 gathers the owners' summaries and writes
``checkpoint.h5``: root attributes (``format``, ``version``, ``step``, the
caller's ``attrs``, ``tensors`` = JSON list of names, ``shard_sha256`` =
JSON {file: digest} of every shard and index file) and, for every tensor,
a virtual dataset of the full logical shape mapped onto its index dataset.
Relative paths throughout, so the directory can be moved, and plain
``h5py`` sees whole tensors::

    with h5py.File("RUN/ckpt/step_00001000/checkpoint.h5") as f:
        wte = f["model/wte"][...]          # (V, h), real vocabulary only

Commit is atomic: everything goes to ``RUN/ckpt/.tmp_step_%08d_<owner>_<random>/``,
rank 0 checks that every file is there with the size its writer reported,
renames it to ``step_%08d`` and only then rewrites ``RUN/ckpt/latest`` (via
a temporary file and ``os.replace``).  A failure on any rank is agreed on
by all ranks, the temporary directory is removed and every rank raises
:class:`CheckpointError`; the previous checkpoint and ``latest`` are
untouched.  A saver removes only temporary directories named with its own
``owner``; :func:`recover`, called while holding the run directory, clears
those of jobs that died.  :func:`latest` falls back to the newest complete
step directory when ``latest`` is missing or names nothing.

Loading verifies, because a missing virtual-dataset source silently reads as
fill values: :func:`open_checkpoint` checks the root attributes (``header``),
the presence and sha256 digest of every shard, and, since a checkpoint is
untrusted input, where every tensor's bytes come from (``storage``): only
from the files it lists, inside its own directory, through hard links, with
no external storage and no virtual source elsewhere.  Given a communicator, the
ranks share the hashing (each hashes the files numbered like itself, which
on the saving layout are the ones it reads) and agree on any problem.
"""
from .format import CKPT_DIR, FORMAT, MAIN_FILE, VERSION, Block, CheckpointError
from .report import inspect
from .read import Checkpoint, latest, open_checkpoint
from .write import recover, save

__all__ = [
    "CKPT_DIR", "FORMAT", "MAIN_FILE", "VERSION", "CheckpointError", "Block", "Checkpoint",
    "save", "recover", "latest", "open_checkpoint", "inspect",
]
