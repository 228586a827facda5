"""MXFP4 weights (:class:`moefuse.formats.MXFP4`, SPEC §6): three sets of kernels, which the experts op chooses
between. ``kernels.py``: W4A16 in Triton (``tl``), launched by :func:`experts_mxfp4` off Hopper, under the
interpreter and for the shapes the Gluon ones do not take; its unpacking (``_unpack_asm``) serves ``ws.py`` too.
``ws.py``: the same W4A16 work warp-specialized in Gluon for Hopper, where ``ws.ws_eligible`` holds. ``w4a8.py``:
W4A8 in Gluon for Hopper (``activation_quant="fp8"``, where ``w4a8.fits`` holds) on 128-row tiles, its activations
quantized as ``fp8/quantize.py`` does; ``w4a8_decode.py``: W4A8 on ``ws.py``'s programs for 16- and 32-row
tiles, the same arithmetic. The op calls ``ws``, ``w4a8`` and ``w4a8_decode`` through their modules
(``ws.ws_eligible(...)``), so a test that patches a module attribute changes what the op runs."""

from . import kernels, w4a8, w4a8_decode, ws
from .kernels import experts_mxfp4, mxfp4_tiles

__all__ = ["experts_mxfp4", "kernels", "mxfp4_tiles", "w4a8", "w4a8_decode", "ws"]
