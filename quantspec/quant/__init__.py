"""quantspec.quant — numerics and artifacts: config dataclasses, the quantize/dequantize
primitives (the single source of numbers), int4 packing, GPTQ, SmoothQuant and the on-disk
artifact format. Pure: takes tensors, never runs a model over data.
"""

from quantspec.quant.args import (
    FORMAT_FLOAT_QUANTIZED,
    FORMAT_INT_QUANTIZED,
    FORMAT_MIXED_PRECISION,
    FORMAT_NAIVE_QUANTIZED,
    FORMAT_PACK_QUANTIZED,
    MIN_GROUP_SIZE,
    QUANT_METHOD,
    QuantArgs,
    QuantType,
    SUPPORTED_FORMATS,
)
from quantspec.quant.config import QuantConfig, resolve_group_size
from quantspec.quant.presets import preset
from quantspec.quant.scheme import QuantScheme, scheme_format
from quantspec.quant.artifact import (
    LinearQuant,
    kv_scale_tensors,
    linear_from_tensors,
    linear_to_tensors,
    load_safetensors,
    read_artifact_config,
    read_provenance,
    read_quant_config,
    write_artifact,
)
from quantspec.quant.gptq import GPTQResult, HessianAccumulator, gptq_quantize, rtn_quantize
from quantspec.quant.packing import INT4_OFFSET, INT4_PER_INT32, pack_int4, pack_int32, unpack_int4, unpack_int32
from quantspec.quant.primitives import (
    FP8_E4M3_MAX,
    choose_qparams,
    dequantize,
    fake_quantize,
    minmax,
    qparams_from_minmax,
    quant_range,
    quantize,
    storage_dtype,
    zero_point_dtype,
)
from quantspec.quant.smoothquant import (
    fold_into_linear,
    fold_into_norm,
    smooth_norm_linears,
    smoothquant_scales,
    weight_input_absmax,
)

__all__ = [
    # args
    "QuantType", "QuantArgs", "QuantScheme", "QuantConfig", "preset", "resolve_group_size",
    "scheme_format", "QUANT_METHOD", "SUPPORTED_FORMATS", "FORMAT_PACK_QUANTIZED",
    "FORMAT_INT_QUANTIZED", "FORMAT_FLOAT_QUANTIZED", "FORMAT_NAIVE_QUANTIZED",
    "FORMAT_MIXED_PRECISION", "MIN_GROUP_SIZE",
    # primitives
    "FP8_E4M3_MAX", "quant_range", "storage_dtype", "zero_point_dtype", "minmax",
    "qparams_from_minmax", "choose_qparams", "quantize", "dequantize", "fake_quantize",
    # packing
    "INT4_OFFSET", "INT4_PER_INT32", "pack_int4", "unpack_int4", "pack_int32", "unpack_int32",
    # algorithms
    "HessianAccumulator", "GPTQResult", "gptq_quantize", "rtn_quantize",
    "smoothquant_scales", "weight_input_absmax", "fold_into_norm", "fold_into_linear",
    "smooth_norm_linears",
    # artifact
    "LinearQuant", "linear_to_tensors", "linear_from_tensors", "kv_scale_tensors",
    "write_artifact", "read_artifact_config", "read_quant_config", "read_provenance",
    "load_safetensors",
]
