"""compressed-tensors' own decompression of an artifact, in a fresh interpreter with a given
compressed-tensors release first on the path:

    python decompress.py CT_DIR OUT_DIR ARTIFACT_DIR...

For every config group, each Linear whose tensors the group's targets name is decompressed by
the compressor registered for the group's format (`BaseCompressor.get_value_from_registry`),
the way compressed-tensors' `ModelCompressor.decompress` does per module; the dense weights of
artifact A go to OUT_DIR/A.safetensors (A: the artifact directory's name) under the Linear's
name, and a JSON line on stdout gives the version and, per artifact, an error for each Linear
whose compressor refuses.
"""

import json
import os
import re
import sys

sys.path.insert(0, sys.argv[1])

import compressed_tensors  # noqa: E402
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def decompress(art: str, out: str) -> dict[str, str]:
    """Decompress artifact `art` into `out`; → {Linear: error} for the Linears refused."""
    cfg_json = json.load(open(f"{art}/config.json"))["quantization_config"]
    cfg = QuantizationConfig.model_validate(cfg_json)
    tensors = load_file(f"{art}/model.safetensors")
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    dense, errors = {}, {}
    for name in names:
        # compressed-tensors' precedence: exact name, then regex, then class name
        hits = []
        for g in cfg.config_groups.values():
            for t in g.targets:
                rank = 0 if t == name else 1 if t.startswith("re:") and re.match(t[3:], name) else \
                    2 if t == "Linear" else None
                if rank is not None:
                    hits.append((rank, g))
        scheme = min(hits, key=lambda h: h[0])[1]
        fmt = scheme.format or cfg.format
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")
                 and k[len(name) + 1:] not in ("input_scale", "input_zero_point")}
        try:
            comp = BaseCompressor.get_value_from_registry(fmt)
            dense[name] = comp.decompress(local, scheme)["weight"].contiguous()
        except Exception as e:  # noqa: BLE001 — its refusal is the answer
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
    save_file(dense, out)
    return errors


def main() -> None:
    out_dir, arts = sys.argv[2], sys.argv[3:]
    errors = {os.path.basename(a): decompress(a, os.path.join(out_dir, os.path.basename(a) + ".safetensors"))
              for a in arts}
    print(json.dumps({"version": compressed_tensors.__version__, "file": compressed_tensors.__file__,
                      "errors": errors}))


if __name__ == "__main__":
    main()
