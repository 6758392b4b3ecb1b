"""The root attributes of ``checkpoint.h5``, parsed as untrusted input.

Any value at all may sit in an attribute of a file someone hands us: an
array where a number belongs, bytes that are not UTF-8, JSON nested a
thousand deep, a step of 1e300, a model dimension of -4 or 2**80. Each
attribute is either what docs/design.md section 6 says it is, or a
:class:`CheckpointError` naming the file and the attribute; no other
exception may escape (tests/test_hostile_files.py fuzzes this with
hypothesis), because a traceback from a bad input file is a crash, not a
message.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.config import MAX_DIM
from .format import FORMAT, VERSION, CheckpointError, _decode_attr
from .meta import check_name

CONFIG_KEYS = ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd")
MAX_STEP = 2**62
_LISTS = ("tensors", "shard_sha256")


@dataclass
class Header:
    """What a reader takes from the root attributes."""

    step: int
    names: list                 # every tensor, by name
    shard_sha256: dict          # {file relative to the step directory: sha256 hex digest}
    attrs: dict                 # every root attribute but the two lists, decoded (JSON as dict/list)


def _show(v) -> str:
    """A value for a one-line message: its repr, cut short."""
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_attrs(attrs, file) -> dict:
    """{name: raw value} of every root attribute (an h5py AttributeManager
    or any mapping); one that h5py cannot read is a CheckpointError."""
    try:
        keys = list(attrs.keys())
    except Exception as e:  # noqa: BLE001 - h5py raises OSError, TypeError, ...
        raise CheckpointError(f"{file}: cannot read root attributes: {e}") from e
    out = {}
    for k in keys:
        try:
            out[k] = attrs[k]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{file}: cannot read root attribute {k!r}: {e}") from e
    return out


def parse_root(raw: dict, file) -> Header:
    """The Header of a checkpoint whose root attributes are ``raw`` (as
    ``read_attrs`` returns them), or a CheckpointError naming what is wrong."""
    def get(key):
        if key not in raw:
            raise CheckpointError(f"{file}: root attribute {key!r} is missing")
        return _decode_attr(raw[key])

    fmt = get("format")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise CheckpointError(f"{file}: attribute 'format' is {_show(fmt)}, expected {FORMAT!r}")
    ver = get("version")
    if not _is_int(ver) or ver != VERSION:
        raise CheckpointError(f"{file}: attribute 'version' is {_show(ver)}; this mpicube reads version {VERSION}")
    step = get("step")
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"{file}: attribute 'step' is {_show(step)}, not an integer step number")
    names = get("tensors")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{file}: attribute 'tensors' is not a JSON list of names")
    for n in names:
        try:
            check_name(n, f"{file}: attribute 'tensors'")
        except CheckpointError as e:
            raise CheckpointError(str(e)) from None
    if len(set(names)) != len(names):
        raise CheckpointError(f"{file}: attribute 'tensors' names a tensor twice")
    shards = get("shard_sha256")
    if not (isinstance(shards, dict) and all(isinstance(v, str) for v in shards.values())):
        raise CheckpointError(f"{file}: attribute 'shard_sha256' is not a JSON object")
    attrs = {k: _decode_attr(v) for k, v in raw.items() if k not in _LISTS}
    return Header(step=step, names=names, shard_sha256=shards, attrs=attrs)


FAMILY_KEYS = ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "rms_eps", "tie_embeddings", "rope_scaling", "n_experts",
               "top_k", "norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef",
               "router", "n_groups", "topk_groups", "routed_scaling_factor", "n_shared_experts", "moe_ffn_hidden",
               "first_k_dense", "bias_update_rate", "bias_update", "seq_aux_loss_coef",   # core.config.DEEPSEEK_MOE
               "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
               "mtp_depth", "mtp_loss_weight")                  # deepseek_v3's multi-token prediction


def model_config(value, file) -> dict:
    """The ``config`` attribute (decoded, or its JSON text) as {key: int}
    for the five keys of CONFIG_KEYS, each a positive integer of at most
    MAX_DIM, n_head dividing n_embd; else a CheckpointError. A Llama
    model's family keys (FAMILY_KEYS) are kept; other keys are left out."""
    if isinstance(value, (str, bytes)):
        value = _decode_attr(value)
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: attribute 'config' is missing or not a JSON object")
    missing = [k for k in CONFIG_KEYS if k not in value]
    if missing:
        raise CheckpointError(f"{file}: attribute 'config' has no {', '.join(missing)}")
    for k in CONFIG_KEYS:
        v = value[k]
        if not _is_int(v) or not 1 <= v <= MAX_DIM:
            raise CheckpointError(f"{file}: attribute 'config': {k} is {_show(v)}, not an integer in 1..{MAX_DIM}")
    if value["n_embd"] % value["n_head"]:
        raise CheckpointError(f"{file}: attribute 'config': n_embd {value['n_embd']} is not a multiple of "
                              f"n_head {value['n_head']}")
    out = {k: value[k] for k in CONFIG_KEYS}
    if "arch" in value:        # the model family's settings (Llama), checked by ModelConfig.from_dict
        out.update({k: value[k] for k in FAMILY_KEYS if k in value})
    return out
