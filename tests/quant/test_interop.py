"""Our tensors, written to disk and read back, decompress with compressed-tensors' own
compressors to exactly our dequantized weights."""

import pytest
import torch

from quantspec.quant import (QuantConfig, choose_qparams, dequantize,
                             linear_to_tensors, load_safetensors, preset, quantize,
                             write_artifact)

ctq = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402

P = "model.layers.3.mlp.down_proj"


@pytest.mark.parametrize("quant_type,symmetric,dtype", [
    ("weight_only_int4", True, torch.float32),
    ("weight_only_int4", False, torch.float32),
    ("weight_only_int4", True, torch.bfloat16),
    ("weight_only_int8", True, torch.float32),
    ("weight_only_int8", False, torch.float32),
    ("a8w8", True, torch.float32),
    ("a8w8_fp8", True, torch.bfloat16),
])
def test_compressed_tensors_decompresses_our_artifact(tmp_path, quant_type, symmetric, dtype):
    cfg = preset(quant_type, group_size=64, symmetric=symmetric)
    args = cfg.weight_args_for(P)
    w = (torch.randn(40, 192, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    s, z = choose_qparams(w, args)
    q = quantize(w, s, z, args)
    ours = dequantize(q, s, z if not symmetric else None, args)
    tensors = linear_to_tensors(P, q, s, z, args, format=cfg.scheme_for(P).format)
    out = write_artifact(tmp_path / "a", tensors, {"quantization_config": cfg.to_dict()})
    loaded = load_safetensors(out)

    ct_cfg = ctq.QuantizationConfig.model_validate(cfg.to_dict())
    scheme = ct_cfg.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    local = {k.removeprefix(P + "."): v for k, v in loaded.items()}
    theirs = compressor.decompress(local, scheme)["weight"]
    assert theirs.dtype == ours.dtype == dtype
    assert torch.equal(theirs, ours)
    # and our config round-trips through compressed-tensors' pydantic model
    assert QuantConfig.from_dict(ct_cfg.model_dump()).weight_args_for(P) == args
