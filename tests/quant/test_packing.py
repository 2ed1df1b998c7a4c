"""int4 packing is bit-exact with compressed-tensors' pack_to_int32 / unpack_from_int32."""

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.quant import pack_int4, unpack_int4

helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


def test_literal_word():
    q = torch.tensor([[-8, -7, 0, 7, 0, 0, 0, 0]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() & 0xFFFFFFFF == 0x8888F810


@pytest.mark.parametrize("shape", [(1, 8), (5, 13), (16, 576), (3, 1), (9, 64)])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_bit_exact_with_compressed_tensors(shape, packed_dim):
    torch.manual_seed(1)
    q = torch.randint(-8, 8, shape, dtype=torch.int8)
    ours = pack_int4(q, packed_dim=packed_dim)
    assert torch.equal(ours, helpers.pack_to_int32(q, 4, packed_dim=packed_dim))
    assert torch.equal(unpack_int4(ours, q.shape, packed_dim=packed_dim), q)
    assert torch.equal(helpers.unpack_from_int32(ours, 4, q.shape, packed_dim=packed_dim), q)


def test_rejects_out_of_range_and_bad_shape():
    with pytest.raises(QuantSpecError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))
    with pytest.raises(QuantSpecError, match="int8"):
        pack_int4(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(QuantSpecError, match="cannot hold"):
        unpack_int4(torch.zeros(2, 1, dtype=torch.int32), (2, 9))
