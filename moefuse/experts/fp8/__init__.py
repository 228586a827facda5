"""fp8 block-scale weights (:class:`moefuse.formats.BlockFP8`, SPEC §5): the routed experts' W8A8 grouped GEMMs
(``kernels.py``, launched by :func:`experts_fp8`); the e4m3 activation quantization per token and 128 columns that
they, the shared expert and the MXFP4 W4A8 kernels share (``quantize.py``: :func:`quantize_rows_into`); and the
fp8 shared expert's MLP on cuBLAS's block-scaled GEMMs at prefill (``mlp.py``: ``mlp.takes``, ``mlp.fp8_mlp``)."""

from . import kernels, mlp, quantize
from .kernels import experts_fp8, fp8_tiles
from .quantize import quantize_rows_into, quantized_rows

__all__ = ["experts_fp8", "fp8_tiles", "kernels", "mlp", "quantize", "quantize_rows_into", "quantized_rows"]
