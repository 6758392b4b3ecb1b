"""``--fp8`` and its options as one ``Recipe`` (ops/fp8_recipes.py), with
the checks that need no MPI: every rank reaches the same verdict before
the first collective. The layouts check their shard widths when they are
built (parallel/fp8.py ``check_shard``)."""

from __future__ import annotations

from ..core.errors import ConfigError
from ..ops.fp8_recipes import RECIPES, Recipe, default_block, default_grad_format

MASTER_TYPES = ("float32", "float64")     # what the emulated GEMMs accumulate in and the weights are kept in


def fp8_recipe(name, dtype: str, grad_format=None, accumulate=None, history: int = 16, rule: str = "max",
               block=None, power_of_2: bool = False):
    """The Recipe of ``--fp8 name`` and its options, or None without --fp8."""
    if name is None:
        return None
    if name not in RECIPES:
        raise ConfigError(f"--fp8: unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    if dtype not in MASTER_TYPES:
        raise ConfigError(f"--fp8 {name} needs --dtype float32 or float64, not {dtype}: FP8 operands are "
                          f"dequantized into the master format, and the emulated GEMMs accumulate in it")
    accumulate = accumulate or dtype
    if accumulate != dtype:
        raise ConfigError(f"--fp8-accumulate {accumulate} needs --dtype {accumulate}: the emulated GEMMs "
                          f"accumulate in the activation format")
    grad_format = grad_format or default_grad_format(name)
    if grad_format not in ("e4m3", "e5m2"):
        raise ConfigError(f"--fp8-grad-format must be e4m3 or e5m2, got {grad_format!r}")
    if block is not None and name not in ("blockwise", "mxfp8"):
        raise ConfigError(f"--fp8-block applies to blockwise and mxfp8, not {name}")
    block = default_block(name) if block is None else block
    if name in ("blockwise", "mxfp8") and block < 1:
        raise ConfigError(f"--fp8-block must be at least 1, got {block}")
    if power_of_2 and name != "rowwise":
        raise ConfigError(f"--fp8-pow2 applies to rowwise, not {name}")
    if history < 1:
        raise ConfigError(f"--fp8-amax-history must be at least 1, got {history}")
    if rule not in ("max", "recent"):
        raise ConfigError(f"--fp8-amax-rule must be max or recent, got {rule!r}")
    from ..ops import fp8
    if fp8.ml_dtypes() is None:
        raise ConfigError("--fp8 needs the ml_dtypes package (its FP8 formats): pip install ml_dtypes "
                          "(or reinstall mpicube)")
    return Recipe(name, grad_format=grad_format, block=block, power_of_2=power_of_2, history=history,
                  history_rule=rule, accumulate=accumulate)
