"""What the experts' Gluon kernels share, whatever the weight format: the TMA load, SwiGLU and the e4m3 quantization
of an fp32 tile (sm_90 only; the ``tl`` kernels' counterparts are in ``common.py``).

- :func:`tma_load`: Gluon's TMA load under the name this Triton gives it.
- :func:`swiglu`: ``SiLU(gate) * up`` after DeepSeek-V4's clamp, as ``common._swiglu`` computes it: the GEMM1
  epilogue of ``mxfp4/ws.py``, ``mxfp4/w4a8.py`` and ``persistent.py``.
- :func:`row_inverse`, :func:`e4m3`, :func:`scale_of`: SPEC §5's quantization of 128 fp32 values of a row, as
  ``fp8/quantize.py``'s ``_quantize`` does it (same bits): the epilogue of the kernels that write GEMM1's
  intermediate quantized (``mxfp4/w4a8.py``, ``persistent.py``).
- :func:`word_position`: the W4A8 kernels' column order within each group of 32 (``mxfp4/w4a8.py``,
  ``w4a8_decode.py``).

A piece one kernel family alone uses stays in its own file. Nothing is defined without Gluon (Triton < 3.5): the
importers then fall back to the ``tl`` kernels.
"""

from __future__ import annotations

import triton.language as tl

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
except ImportError:  # pragma: no cover - every supported Triton has it
    gluon = None

if gluon is not None:
    # Triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 async_load (the old name a deprecated alias).
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    @gluon.jit
    def swiglu(gate, up, limit, HAS_LIMIT: gl.constexpr):
        """SiLU(gate) * up in fp32 after DeepSeek-V4's clamp (gate <= limit, up within [-limit, limit]) where
        ``HAS_LIMIT``, as ``common._swiglu`` (NaN stays NaN, as torch.clamp keeps it)."""
        if HAS_LIMIT:
            gate = gl.where(gate > limit, limit, gate)
            up = gl.where(up > limit, limit, gl.where(up < -limit, -limit, up))
        return gate * (1.0 / (1.0 + gl.exp(-gate))) * up

    @gluon.jit
    def max_keeping_nan(a, b):
        """``max(a, b)``, NaN if either is: the combine function of an amax that must keep a NaN."""
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def e4m3(y):
        """fp32 within [-448, 448] after the clamp (NaN stays NaN: the hardware's min and max would drop it) -> e4m3,
        rounded to nearest even."""
        y = gl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL)
        return gl.minimum(y, 448.0, propagate_nan=tl.PropagateNan.ALL).to(gl.float8e4nv)

    @gluon.jit
    def row_inverse(left, right, AXIS: gl.constexpr):
        """What SPEC §5's quantization (as ``fp8.quantize._quantize``) multiplies 128 fp32 values of each row by,
        the row held as two halves (its values along ``AXIS``): 448 / amax (0 for an all-zero row), broadcast
        along ``AXIS``, and the row's amax, whose scale (:func:`scale_of`) the caller stores. Each half's values
        are then ``e4m3(half * inverse)``."""
        amax = gl.maximum(gl.reduce(gl.abs(left), AXIS, max_keeping_nan),
                          gl.reduce(gl.abs(right), AXIS, max_keeping_nan), propagate_nan=tl.PropagateNan.ALL)
        return gl.expand_dims(gl.where(amax > 0, gl.div_rn(full_448(amax), amax), 0.0), AXIS), amax

    @gluon.jit
    def word_position(n):
        """Where the W4A8 kernels want column ``n`` of an e4m3 operand (``fp8.quantize``'s pass
        writes rows in it with ``word_order``): within each group of 32, column 8t + 4h + j at 4t + 16h + j."""
        return (n & ~31) | (n & 3) | (((n >> 3) & 3) << 2) | (((n >> 2) & 1) << 4)

    @gluon.jit
    def full_448(amax):
        """448.0 (the largest e4m3) in ``amax``'s shape and layout: a tensor divisor, so each division rounds once."""
        return gl.full(amax.shape, 448.0, gl.float32, amax.type.layout)

    @gluon.jit
    def scale_of(amax):
        """A row's quantization scale from its amax (SPEC §5: amax / 448, rounded once)."""
        return gl.div_rn(amax, full_448(amax))
