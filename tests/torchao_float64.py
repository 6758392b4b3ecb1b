"""torchao's float8 training, emulated, held to mpicube's FP8 arithmetic in
a float64 model (tests that compare the two; never imported by mpicube).

torchao's emulation (``Float8LinearConfig(emulate=True)``) dequantizes
and multiplies in float32 (``float8_ops``: ``a._data.float() / a._scale``,
then ``torch.mm``), which would put float32's rounding into a float64
comparison, as transformers' float32 RMSNorm does (tests/hf_float64.py).
And in a float64 model it takes the amax and the scaled product of the
float64 tensor, where mpicube quantizes the operand rounded to float32
first, as a framework's float32 or bfloat16 activations hold it
(``ops/fp8.group_amax``, ``ops/fp8.quantize``). Two patches:

* every tensor torchao quantizes is rounded to float32 before its amax
  and its scaling (a float32 tensor goes on to torchao's own cast);
* its emulated GEMMs dequantize (FP8 value / scale) and multiply in
  float64, exactly as ``--fp8-accumulate float64`` does.

Then the FP8 bytes and scales are the same, and one training step's loss
and gradients agree to float64's rounding of the two GEMM orders.
"""

from __future__ import annotations


def patch(monkeypatch, torch):
    """Apply both patches for the test's duration (``monkeypatch``)."""
    from torchao.float8 import float8_linear, float8_ops

    quantize = float8_linear.hp_tensor_to_float8_dynamic

    def from_float32(hp_tensor, *args, **kwargs):
        return quantize(hp_tensor.to(torch.float32), *args, **kwargs)

    def wide(t):                                                      # an FP8 operand's values, in float64
        return t._data.to(torch.float64) / t._scale.to(torch.float64)

    def mm(aten_op, args, kwargs=None):
        return torch.mm(wide(args[0]), wide(args[1]))

    def addmm(aten_op, args, kwargs=None):
        return torch.mm(wide(args[1]), wide(args[2])) + args[0]

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", from_float32)
    aten = torch.ops.aten
    for op, f in ((aten.mm.default, mm), (aten.matmul.default, mm), (aten.addmm.default, addmm)):
        monkeypatch.setitem(float8_ops.FLOAT8_OPS_TABLE, op, f)
