"""The options that say which number formats a command computes in: the
device, --dtype (and the GPU's TF32), and FP8's recipe with its options
(docs/fp8.md); train, eval, bench, trace and info take them."""

from __future__ import annotations

import functools

import click

DTYPE_CHOICES = ("float32", "float64", "float16", "bfloat16")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")   # ops/fp8_recipes.py RECIPES


def fp8_options(f):
    """``--fp8 RECIPE`` and its options (train, trace, bench, info): every
    linear's GEMMs quantized to FP8, emulated exactly (docs/fp8.md)."""
    f = click.option("--fp8-pow2", is_flag=True, default=False,
                     help="fp8 rowwise: scales rounded down to powers of two")(f)
    f = click.option("--fp8-block", type=int, default=None,
                     help="fp8 blockwise/mxfp8: tile length along the contraction  [default: 128, 32]; smaller "
                          "only to test small models")(f)
    f = click.option("--fp8-amax-rule", type=click.Choice(["max", "recent"]), default="max", show_default=True,
                     help="fp8 delayed: scale from the history's max or its most recent amax")(f)
    f = click.option("--fp8-amax-history", type=int, default=16, show_default=True,
                     help="fp8 delayed: steps of amax history")(f)
    f = click.option("--fp8-accumulate", type=click.Choice(["float32", "float64"]), default=None,
                     help="fp8: the emulated GEMMs' accumulation (must match --dtype)  [default: --dtype]")(f)
    f = click.option("--fp8-grad-format", type=click.Choice(["e4m3", "e5m2"]), default=None,
                     help="fp8: format of the output gradient dy  [default: e5m2 for tensorwise and delayed, "
                          "else e4m3]")(f)
    f = click.option("--fp8", type=click.Choice(FP8_RECIPES), default=None, metavar="RECIPE",
                     help="quantize every linear's GEMM operands to FP8: tensorwise, delayed, rowwise, "
                          "blockwise (DeepSeek-V3), mxfp8 (OCP MX)  [default: off]")(f)
    return f


def fp8_recipe_options(f):
    """``fp8_options`` handed to the command as one value, ``fp8``: the
    Recipe (or None), built with the command's --dtype, --device and --ep
    (bench, info; train keeps the options apart, in its TrainOptions)."""
    from ..training.fp8_options import fp8_recipe

    @functools.wraps(f)
    def command(**kw):
        o = {k: kw.pop(k) for k in ("fp8", "fp8_grad_format", "fp8_accumulate", "fp8_amax_history",
                                    "fp8_amax_rule", "fp8_block", "fp8_pow2")}
        kw["fp8"] = fp8_recipe(o["fp8"], kw.get("dtype") or "float32", grad_format=o["fp8_grad_format"],
                               accumulate=o["fp8_accumulate"], history=o["fp8_amax_history"],
                               rule=o["fp8_amax_rule"], block=o["fp8_block"], power_of_2=o["fp8_pow2"],
                               ep=kw.get("ep") or 1)
        return f(**kw)

    return fp8_options(command)


def device_options(f):
    f = click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
                     help="NumPy on CPUs or CuPy, one GPU per rank")(f)
    f = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
                     help="float64 verifies, float32 trains; float16 and bfloat16 train in mixed precision "
                          "(16-bit activations and communication, float32 master weights)")(f)
    f = click.option("--tf32", is_flag=True, default=False,
                     help="GPU: float32 GEMMs on tensor cores (TF32 inputs, float32 accumulation)")(f)
    return f


# --------------------------------------------------------------------------- commands
