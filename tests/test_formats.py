"""Weight formats' cuts (what the sharded layer slices experts with): views equal to slicing the dequantized weight,
refused where they would split a scale block."""

from __future__ import annotations

import pytest
import torch

from moefuse.formats import LAYER_FORMATS, MXFP4, BlockFP8, layer_format


@pytest.mark.parametrize("cls, rows, cols", [(BlockFP8, (128, 384), (128, 256)), (MXFP4, (5, 77), (64, 160))])
def test_cuts_are_slices_of_the_weight(cls, rows, cols, gen):
    weight = cls.quantize(torch.randn(3, 512, 256, generator=gen))
    dense = weight.dequantize(torch.float64)
    cut = weight.rows(*rows)
    assert cut.values.untyped_storage().data_ptr() == weight.values.untyped_storage().data_ptr()  # a view
    assert torch.equal(cut.dequantize(torch.float64), dense[:, slice(*rows)])
    assert torch.equal(weight.cols(*cols).dequantize(torch.float64), dense[:, :, slice(*cols)])
    both = cls.cat_rows([weight.rows(*rows), weight.rows(0, rows[0])])
    assert torch.equal(both.dequantize(torch.float64), torch.cat([dense[:, slice(*rows)], dense[:, : rows[0]]], 1))
    assert torch.equal(weight[1:].rows(*rows).dequantize(torch.float64), dense[1:, slice(*rows)])


def test_partial_last_block_and_refused_cuts(gen):
    edge = BlockFP8.quantize(torch.randn(1, 200, 136, generator=gen))
    assert torch.equal(edge.rows(128, 200).dequantize(), edge.dequantize()[:, 128:])  # the last, partial block
    three = BlockFP8.quantize(torch.randn(1, 300, 128, generator=gen))  # blocks of 128, 128 and 44 rows
    assert torch.equal(three.rows(128, 256).dequantize(), three.dequantize()[:, 128:256])
    for cut in (lambda: edge.rows(5, 128), lambda: edge.cols(0, 100), lambda: edge.rows(128, 128)):
        with pytest.raises(ValueError, match="BlockFP8"):
            cut()
    packed = MXFP4.quantize(torch.randn(1, 8, 64, generator=gen))
    with pytest.raises(ValueError, match="MXFP4.*32"):
        packed.cols(16, 64)


def test_layer_formats_own_their_parameters():
    """``LAYER_FORMATS``: each format's parameters (transformers' names and dtypes), the weight the experts op takes
    over them, and the check of loaded tensors; an unknown name is refused naming the argument."""
    E, N, K = 3, 256, 96
    plain, fp8, mxfp4 = (LAYER_FORMATS[name] for name in (None, "fp8", "mxfp4"))
    assert not plain.quantized and fp8.quantized and mxfp4.quantized
    (w,) = plain.params(E, N, K, torch.bfloat16, "cpu")
    assert w.shape == (E, N, K) and w.dtype == torch.bfloat16 and w.requires_grad and plain.weight(w) is w
    values, scales = fp8.params(E, N, K, torch.bfloat16, "cpu")
    assert (values.dtype, scales.dtype, tuple(scales.shape)) == (torch.float8_e4m3fn, torch.float32, (E, 2, 1))
    assert isinstance(fp8.weight(values, scales), BlockFP8) and fp8.suffixes == ("", "_scale_inv")
    values, scales = mxfp4.params(E, N, K, torch.bfloat16, "cpu")
    assert (values.dtype, tuple(values.shape), scales.dtype) == (torch.int8, (E, N, K // 2), torch.float8_e8m0fnu)
    assert isinstance(mxfp4.weight(values, scales), MXFP4) and mxfp4.width_step == 32
    scales.view(torch.uint8).fill_(127)
    mxfp4.check(values, scales)
    scales.view(torch.uint8)[0, 0, 0] = 255  # NaN: outside the kernels' range
    with pytest.raises(ValueError, match="scales"):
        mxfp4.check(values, scales)
    assert mxfp4.shared_width_step is None and fp8.shared_width_step == 128 and mxfp4.implied_shared == "fp8"
    assert (plain.weight_type, fp8.weight_type, mxfp4.weight_type) == (torch.Tensor, BlockFP8, MXFP4)
    with pytest.raises(ValueError, match="shared_quant"):
        layer_format("int4", "shared_quant")
