"""How much memory a model needs and how much this process may still
take, so that a size no machine could hold is refused in one line before
anything is built (docs/design.md section 6: sizes are checked arithmetically
against the file's real size and this rank's memory before allocation).

Every figure here is a lower bound of the need set against an upper bound
of the room: a model is refused only when it cannot fit, never because an
estimate was generous. The arithmetic is on Python integers, which do not
overflow, so a header claiming 2**31 layers of 2**31 columns gives a number
to compare instead of an exception.

The room is the smaller of the machine's physical memory and, under an
address-space limit (``ulimit -v``, RLIMIT_AS), what is left below that
limit. A memory map needs address space but no memory, so it is checked
against the limit alone (``require_address``).
"""

from __future__ import annotations

import os

from .errors import ConfigError

try:                                    # POSIX; elsewhere only physical memory counts
    import resource
except ImportError:                     # pragma: no cover
    resource = None

# Bookkeeping a rank keeps per parameter tensor: its declaration, the
# layout's spec with its index arrays, views into the flat buffers, names.
# About 1.8 KB measured on the serial layout (CPython 3.11); the bound takes
# less, so that only a model whose tensor list cannot fit is refused.
BYTES_PER_TENSOR = 1024
LAYER_TENSORS = 12                      # ln_1 (2), c_attn (2), c_proj (2), ln_2 (2), c_fc (2), mlp.c_proj (2)
ADDRESS_BITS = 47                       # user address space of x86-64 and arm64 Linux


def tensor_count(n_layer: int) -> int:
    """Parameter tensors of a GPT-2 of ``n_layer`` blocks: wte, wpe, 12 per
    block, ln_f's two."""
    return LAYER_TENSORS * n_layer + 4


def format_count(n: int) -> str:
    """1234567 -> '1,234,567'; a number too long to print (a JSON
    configuration's ints may have thousands of digits) as its power of 2."""
    return f"{n:,}" if n.bit_length() <= 100 else f"about 2^{n.bit_length() - 1}"


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; for any Python int (no float overflow, no
    conversion of a huge int to its digits)."""
    if n >= 1 << 80:
        return f"about 2^{n.bit_length() - 1} bytes"
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _address_limit():
    """The soft RLIMIT_AS in bytes, or None when there is none."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def _mapped() -> int:
    """Bytes of address space this process has mapped (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def physical() -> int:
    """The machine's physical memory in bytes (0 if the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def available(address_only: bool = False) -> tuple:
    """(bytes, words saying where the figure comes from) this process may
    still allocate; ``address_only``: only the address-space room (what a
    memory map needs)."""
    room, why = 1 << ADDRESS_BITS, "the address space is smaller"
    phys = 0 if address_only else physical()
    if phys:
        room, why = phys, f"this machine has {format_bytes(phys)} of physical memory"
    limit = _address_limit()
    if limit is not None:
        left = max(0, limit - _mapped())
        if left < room:
            room, why = left, (f"this process has {format_bytes(left)} left under its address-space limit of "
                               f"{format_bytes(limit)}")
    return room, why


def require(need: int, what: str, room=None, address_only: bool = False, purpose: str = "") -> None:
    """ConfigError, one line, when ``need`` bytes cannot fit: ``what``
    needs them (``purpose``: for what); ``room`` is (bytes, words that
    complete "but ..."), by default ``available()``."""
    room, why = room if room is not None else available(address_only)
    if need > room:
        kind = "address space" if address_only else "memory"
        raise ConfigError(f"{what} needs at least {format_bytes(need)} of {kind}{purpose}, but {why}")


def require_tensors(n_layer: int, what: str = "the model") -> None:
    """Refuse a model whose list of parameter tensors alone cannot fit (a
    header or option claiming millions of layers), before it is built."""
    n = tensor_count(n_layer)
    require(n * BYTES_PER_TENSOR, f"{what} (n_layer {format_count(n_layer)}: {format_count(n)} parameter "
                                  f"tensors, {BYTES_PER_TENSOR} bytes of bookkeeping each)")


def require_address(nbytes: int, what: str) -> None:
    """Refuse a memory map of ``nbytes`` that the address space cannot take
    (under ``ulimit -v``); it needs no memory until its pages are read."""
    require(nbytes, what, address_only=True)
