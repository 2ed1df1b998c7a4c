"""A checkpoint's compressed-tensors `transform_config`: what it records of transforms applied to
the weights (the rotations `quantize --rotate` fuses, `calib.rotate`; llm-compressor's SpinQuant
R1 / R2), read by compressed-tensors' own model. quantspec runs weights whose transforms are fused
(`weight_input` / `weight_output`: nothing is left to run), as vLLM does; a transform applied at
run time (QuIP's, SpinQuant's R3 / R4) is refused in one line, as SGLang and transformers would
silently skip it."""

from __future__ import annotations

import json
from typing import Any

from quantspec.errors import QuantSpecError

__all__ = ["OFFLINE", "read_transform_config"]

OFFLINE = ("weight_input", "weight_output")


def read_transform_config(tc: Any, where: str) -> dict | None:
    """A checkpoint's `transform_config`, checked by compressed-tensors' own model: None when
    empty; refused in one line when a transform runs at run time (quantspec runs weights whose
    transforms are fused; vLLM runs run-time ones too, SGLang and transformers none)."""
    if not tc:
        return None
    from compressed_tensors.transform import TransformConfig

    try:
        parsed = TransformConfig.model_validate(tc)
    except Exception as e:  # pydantic's ValidationError, several lines: the first says what
        first = str(e).strip().splitlines()
        raise QuantSpecError(f"{where}.transform_config is malformed ({' '.join(first[:3])[:200]}); "
                             "re-export the checkpoint") from None
    for name, scheme in parsed.config_groups.items():
        for a in scheme.apply:
            loc = getattr(a.location, "value", a.location)
            if loc not in OFFLINE:
                raise QuantSpecError(
                    f"{where}.transform_config[{name!r}] applies a {scheme.type} transform at run time (location "
                    f"{loc!r} on {', '.join(a.targets[:2])}); quantspec runs rotations fused into the weights only "
                    "(SGLang and transformers ignore run-time transforms; vLLM runs them): quantize the float model "
                    "with --rotate R1,R2 instead")
    return json.loads(json.dumps(parsed.model_dump()))
