"""The bad-input catalogue: every case runs through the real CLI (click's runner over `quantspec.cli.main`)
and must end with exit status 2, exactly one line on stderr, no traceback, the name of the flag that
fixes it in that line, and nothing left on disk (the case's directory holds exactly what it held
before, and no output directory was created).

Each case is (id, argv, flag). Placeholders in argv: `{model}` a tiny Llama checkpoint (a private
copy per case), `{d}` the case's own directory, which holds the input files written by `_inputs`,
`{ro}` a location no file can be created in (a read-only or pseudo filesystem).
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantspec.cli import main
from quantspec.model_zoo.tiny import TINY_CORPUS

RO_ROOT = Path("/proc")  # no regular file can be created here, whoever runs the tests

CASES = [
    # -- infer -------------------------------------------------------------------------------
    ("infer-batch-size-0", "infer --model {model} --prompt hi --batch-size 0", "--batch-size"),
    ("infer-max-new-tokens-0", "infer --model {model} --prompt hi --max-new-tokens 0", "--max-new-tokens"),
    ("infer-max-length-1", "infer --model {model} --prompt hi --max-length 1", "--max-length"),
    ("infer-src-length-over", "infer --model {model} --prompt hi --max-length 64 --src-length 64", "--src-length"),
    ("infer-block-size-3", "infer --model {model} --prompt hi --block-size 3", "--block-size"),
    ("infer-gptq-asym", "infer --model {d}/gptq_asym --prompt hi", "--model"),
    ("infer-temperature-neg", "infer --model {model} --prompt hi --decode-strategy sampling --temperature -1",
     "--temperature"),
    ("infer-top-p-0", "infer --model {model} --prompt hi --decode-strategy sampling --top-p 0", "--top-p"),
    ("infer-presence-penalty-3", "infer --model {model} --prompt hi --presence-penalty 3", "--presence-penalty"),
    ("infer-repetition-penalty-0", "infer --model {model} --prompt hi --repetition-penalty 0", "--repetition-penalty"),
    ("infer-min-p-2", "infer --model {model} --prompt hi --decode-strategy sampling --min-p 2", "--min-p"),
    ("infer-logprobs-no-output-file", "infer --model {model} --prompt hi --logprobs 2", "--output-file"),
    ("infer-top-k-neg", "infer --model {model} --prompt hi --decode-strategy sampling --top-k -1", "--top-k"),
    ("infer-draft-num-neg", "infer --model {model} --prompt hi --speculate-method inference_with_reference "
                            "--speculate-max-draft-token-num -1", "--speculate-max-draft-token-num"),
    ("infer-ngram-0", "infer --model {model} --prompt hi --speculate-method inference_with_reference "
                      "--speculate-max-ngram-size 0", "--speculate-max-ngram-size"),
    ("infer-kv-cache-memory-no-unit", "infer --model {model} --prompt hi --kv-cache-memory 4", "--kv-cache-memory"),
    ("infer-kv-cache-memory-too-small", "infer --model {model} --prompt hi --kv-cache-memory 64KiB",
     "--kv-cache-memory"),
    ("infer-regex-bad", "infer --model {model} --prompt hi --regex '([a-z'", "--regex"),
    ("infer-regex-and-choice", "infer --model {model} --prompt hi --regex a --choice b", "--choice"),
    ("infer-json-schema-missing", "infer --model {model} --prompt hi --json-schema {d}/missing.json", "--json-schema"),
    ("infer-no-prompt", "infer --model {model}", "--prompt"),
    ("infer-prompt-and-data", "infer --model {model} --prompt hi --data-file {d}/ok.jsonl", "--data-file"),
    ("infer-data-missing", "infer --model {model} --data-file {d}/missing.jsonl", "--data-file"),
    ("infer-data-not-utf8", "infer --model {model} --data-file {d}/latin1.jsonl", "--data-file"),
    ("infer-data-malformed", "infer --model {model} --data-file {d}/malformed.jsonl", "--data-file"),
    ("infer-data-no-src", "infer --model {model} --data-file {d}/nosrc.jsonl", "--data-file"),
    ("infer-data-empty", "infer --model {model} --data-file {d}/empty.jsonl", "--data-file"),
    ("infer-prompt-too-long", "infer --model {model} --prompt '{long}' --no-chat-template --max-length 64 "
                              "--max-new-tokens 8", "--truncate-prompt"),
    ("infer-output-read-only", "infer --model {model} --prompt hi --output-file {ro}/out.jsonl", "--output-file"),
    ("infer-output-under-file", "infer --model {model} --prompt hi --output-file {d}/a_file/out.jsonl",
     "--output-file"),
    ("infer-output-is-dir", "infer --model {model} --prompt hi --output-file {d}", "--output-file"),
    ("infer-stats-read-only", "infer --model {model} --prompt hi --benchmark --stats-file {ro}/s.json",
     "--stats-file"),
    ("infer-stats-under-file", "infer --model {model} --prompt hi --stats-file {d}/a_file/sub/s.json",
     "--stats-file"),
    ("infer-model-missing", "infer --model {d}/no-such-model --prompt hi", "--model"),
    ("infer-model-truncated", "infer --model {d}/truncated --prompt hi", "--model"),
    ("infer-shard-missing", "infer --model {d}/shard_missing --prompt hi", "model-00002-of-00002.safetensors"),
    ("infer-shard-truncated", "infer --model {d}/shard_truncated --prompt hi", "model-00002-of-00002.safetensors"),
    ("infer-model-bad-config", "infer --model {d}/badconfig --prompt hi", "--model"),
    ("infer-gemma-embedding-model", "infer --model {d}/gemma_bidirectional --prompt hi", "--model"),
    ("infer-model-no-tokenizer", "infer --model {d}/no_tokenizer --prompt hi", "--model"),
    ("infer-draft-without-model", "infer --model {model} --prompt hi --speculate-method draft", "--draft-model"),
    ("infer-draft-model-no-method", "infer --model {model} --prompt hi --draft-model {model}",
     "--speculate-method"),
    ("infer-kv-int8-no-scales", "infer --model {model} --prompt hi --cachekv-int8-type static", "--calib"),
    ("infer-kv-dtype-no-scales", "infer --model {model} --prompt hi --kv-cache-dtype fp8", "--calib"),
    ("infer-kv-dtype-and-cachekv", "infer --model {model} --prompt hi --kv-cache-dtype fp8 "
                                   "--cachekv-int8-type static", "--kv-cache-dtype"),
    ("infer-kv-dtype-float-calib", "infer --model {model} --prompt hi --kv-cache-dtype float --calib {d}/no-table",
     "--kv-cache-dtype"),
    ("serve-calib-no-kv-dtype", "serve --model {model} --calib {d}/no-table", "--kv-cache-dtype"),
    ("serve-tensor-parallel", "serve --model {model} -tp 2", "--tensor-parallel-size"),
    ("serve-model-no-tokenizer", "serve --model {d}/no_tokenizer", "--model"),
    ("serve-quantization-float-model", "serve --model {model} --quantization compressed-tensors", "--quantization"),
    ("infer-kv-two-types", "infer --model {model} --prompt hi --cachekv-int8-type static "
                           "--cachekv-fp8-type static", "--cachekv-int8-type"),
    ("infer-min-confidence-ngram", "infer --model {model} --prompt hi --speculate-method inference_with_reference "
                                   "--speculate-min-confidence 0.5", "--speculate-min-confidence"),
    ("infer-tree-malformed", "infer --model {model} --prompt hi --speculate-method medusa --draft-model {d}/medusa "
                             "--speculate-tree 4y2", "--speculate-tree"),
    ("infer-tree-not-medusa", "infer --model {model} --prompt hi --speculate-method inference_with_reference "
                              "--speculate-tree 4x2", "--speculate-tree"),
    ("infer-dynamic-tree-no-nodes", "infer --model {model} --prompt hi --speculate-method medusa --draft-model "
                                    "{d}/medusa --speculate-tree 4x2:0", "--speculate-tree"),
    ("infer-dynamic-tree-too-many", "infer --model {model} --prompt hi --speculate-method medusa --draft-model "
                                    "{d}/medusa --speculate-tree 2x2:7", "--speculate-tree"),
    ("infer-medusa-without-heads", "infer --model {model} --prompt hi --speculate-method medusa", "--draft-model"),
    ("infer-medusa-no-num-heads", "infer --model {model} --prompt hi --speculate-method medusa "
                                  "--draft-model {d}/medusa_nokeys", "--draft-model"),
    ("infer-medusa-other-base", "infer --model {model} --prompt hi --speculate-method medusa "
                                "--draft-model {d}/medusa_otherbase", "--draft-model"),
    ("infer-medusa-vocab-outside", "infer --model {model} --prompt hi --speculate-method medusa "
                                   "--draft-model {d}/medusa_badvocab", "--draft-model"),
    ("infer-eagle-without-head", "infer --model {model} --prompt hi --speculate-method eagle", "--draft-model"),
    ("infer-eagle-not-a-head", "infer --model {model} --prompt hi --speculate-method eagle "
                               "--draft-model {d}/medusa", "--draft-model"),
    ("infer-eagle-other-hidden", "infer --model {model} --prompt hi --speculate-method eagle "
                                 "--draft-model {d}/eagle_hidden32", "--draft-model"),
    ("infer-eagle-other-vocab", "infer --model {model} --prompt hi --speculate-method eagle "
                                "--draft-model {d}/eagle_vocab1024", "--draft-model"),
    ("infer-eagle-aux-out-of-range", "infer --model {model} --prompt hi --speculate-method eagle "
                                     "--draft-model {d}/eagle_aux9", "--draft-model"),
    ("infer-eagle-d2t-outside", "infer --model {model} --prompt hi --speculate-method eagle "
                                "--draft-model {d}/eagle_badd2t", "--draft-model"),
    ("infer-eagle-speculators-dflash", "infer --model {model} --prompt hi --speculate-method eagle "
                                       "--draft-model {d}/speculators_dflash", "--draft-model"),
    ("infer-eagle-speculators-other-embedding", "infer --model {model} --prompt hi --speculate-method eagle "
                                                "--draft-model {d}/speculators_other_embed", "--draft-model"),
    ("infer-device-cuda", "infer --model {model} --prompt hi --device cuda", "--device"),
    ("train-eagle3-aux-out-of-range", "zoo train-draft-head --kind eagle3 --model {model} --aux-layer-ids 0,1,9 "
                                      "--out {d}/head", "--aux-layer-ids"),
    ("infer-device-bogus", "infer --model {model} --prompt hi --device tpu", "--device"),
    # -- quantize ----------------------------------------------------------------------------
    ("quantize-unknown-type", "quantize --model {model} --quant-type int3 --out {d}/q", "--quant-type"),
    ("quantize-group-size-0", "quantize --model {model} --quant-type weight_only_int4 --group-size 0 --out {d}/q",
     "--group-size"),
    ("quantize-group-size-7", "quantize --model {model} --quant-type weight_only_int4 --group-size 7 --out {d}/q",
     "--group-size"),
    ("quantize-gptq-no-data", "quantize --model {model} --quant-type weight_only_int4 --method gptq --out {d}/q",
     "--dataset"),
    ("quantize-gptq-samples-0", "quantize --model {model} --quant-type weight_only_int4 --method gptq "
                                "--dataset {d}/calib.txt --num-samples 0 --out {d}/q", "--num-samples"),
    ("quantize-gptq-seq-len-0", "quantize --model {model} --quant-type weight_only_int4 --method gptq "
                                "--dataset {d}/calib.txt --seq-len 0 --out {d}/q", "--seq-len"),
    ("quantize-gptq-data-not-utf8", "quantize --model {model} --quant-type weight_only_int4 --method gptq "
                                    "--dataset {d}/latin1.txt --out {d}/q", "--dataset"),
    ("quantize-damp-neg", "quantize --model {model} --quant-type weight_only_int4 --method gptq "
                          "--dataset {d}/calib.txt --damp -1 --out {d}/q", "--damp"),
    ("quantize-awq-duo-rtn", "quantize --model {model} --quant-type weight_only_int4 --awq-duo-scaling both "
                             "--out {d}/q", "--awq-duo-scaling"),
    ("quantize-no-quant-type", "quantize --model {model} --out {d}/q", "--quant-type"),
    ("quantize-recipe-missing", "quantize --model {model} --recipe {d}/missing.yaml --out {d}/q", "--recipe"),
    ("quantize-recipe-not-yaml", "quantize --model {model} --recipe {d}/malformed.jsonl --out {d}/q", "--recipe"),
    ("quantize-recipe-sparsity", "quantize --model {model} --recipe {d}/sparse.yaml --out {d}/q", "--recipe"),
    ("quantize-recipe-and-quant-type", "quantize --model {model} --recipe {d}/w4a16.yaml --quant-type a8w8 "
                                       "--out {d}/q", "--quant-type"),
    ("quantize-a8w8-no-calib", "quantize --model {model} --quant-type a8w8 --out {d}/q", "--calib"),
    ("quantize-kv-no-table", "quantize --model {model} --quant-type weight_only_int8 --kv-cache fp8 --out {d}/q",
     "--dataset"),
    ("quantize-one-shot-missing-data", "quantize --model {model} --quant-type a8w8_fp8 --dataset {d}/none.jsonl "
                                       "--out {d}/q", "--dataset"),
    ("quantize-one-shot-too-little-data", "quantize --model {model} --quant-type a8w8_fp8 --dataset {d}/ok.jsonl "
                                          "--num-samples 64 --out {d}/q", "--num-samples"),
    ("quantize-weight-strategy-int4", "quantize --model {model} --quant-type weight_only_int4 --weight-strategy "
                                      "tensor --out {d}/q", "--weight-strategy"),
    ("quantize-weight-strategy-block", "quantize --model {model} --quant-type a8w8_fp8 --activations dynamic "
                                       "--weight-strategy tensor --weight-block 128 --out {d}/q", "--weight-strategy"),
    ("quantize-act-order-rtn", "quantize --model {model} --quant-type weight_only_int4 --act-order --out {d}/q",
     "--act-order"),
    ("quantize-awq-no-data", "quantize --model {model} --quant-type weight_only_int4 --method awq --out {d}/q",
     "--dataset"),
    ("quantize-awq-a8w8", "quantize --model {model} --quant-type a8w8_fp8 --activations dynamic --method awq "
                          "--dataset {d}/calib.txt --out {d}/q", "--method"),
    ("quantize-nvfp4-no-calib", "quantize --model {model} --quant-type nvfp4 --out {d}/q", "--calib"),
    ("quantize-autoround-no-data", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                                   "--out {d}/q", "--dataset"),
    ("quantize-autoround-fp8", "quantize --model {model} --quant-type a8w8_fp8 --activations dynamic --method "
                               "autoround --dataset {d}/calib.txt --out {d}/q", "--method"),
    ("quantize-autoround-layer-type-fp8", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                                          "--dataset {d}/calib.txt --layer-quant-type re:.*down_proj$=a8w8_fp8 "
                                          "--out {d}/q", "--method"),
    ("quantize-iters-rtn", "quantize --model {model} --quant-type weight_only_int4 --iters 5 --out {d}/q", "--iters"),
    ("quantize-autoround-iters-0", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                                   "--dataset {d}/calib.txt --iters 0 --out {d}/q", "--iters"),
    ("quantize-autoround-lr-neg", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                                  "--dataset {d}/calib.txt --lr -0.1 --out {d}/q", "--lr"),
    ("quantize-autoround-mse", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                               "--dataset {d}/calib.txt --weight-observer mse --out {d}/q", "--weight-observer"),
    ("quantize-autoround-quip", "quantize --model {model} --quant-type weight_only_int4 --method autoround "
                                "--dataset {d}/calib.txt --quip v --target vllm --out {d}/q", "--quip"),
    ("quantize-rotate-unknown", "quantize --model {model} --quant-type weight_only_int8 --rotate R3 --out {d}/q",
     "--rotate"),
    ("quantize-rotate-r2-alone", "quantize --model {model} --quant-type weight_only_int8 --rotate R2 --out {d}/q",
     "--rotate"),
    ("quantize-rotate-r4-portable", "quantize --model {model} --quant-type weight_only_int8 --rotate R1,R2,R4 "
     "--out {d}/q", "--target"),
    ("quantize-rotate-r4-and-quip", "quantize --model {model} --quant-type weight_only_int8 --rotate R4 --quip v "
     "--target vllm --out {d}/q", "--quip"),
    ("calibrate-rotate-r4-twice", "calibrate --model {model} --dataset {d}/calib.txt --rotate R4,R1,R4 --out {d}/t",
     "--rotate"),
    ("quantize-quip-portable", "quantize --model {model} --quant-type weight_only_int4 --quip v --out {d}/q",
     "--target"),
    ("quantize-quip-unknown", "quantize --model {model} --quant-type weight_only_int4 --quip w --target vllm "
     "--out {d}/q", "--quip"),
    ("quantize-quip-block-not-pow2", "quantize --model {model} --quant-type weight_only_int4 --quip v "
     "--quip-block-size 48 --target vllm --out {d}/q", "--quip-block-size"),
    ("quantize-quip-static-inputs", "quantize --model {model} --quant-type a8w8 --quip v --target vllm "
     "--calib {d}/nowhere --out {d}/q", "--activations"),
    ("quantize-nvfp4-asym", "quantize --model {model} --quant-type weight_only_nvfp4 --asym --out {d}/q", "--asym"),
    ("quantize-nvfp4-dynamic", "quantize --model {model} --quant-type nvfp4 --activations dynamic --calib {d}/t "
                               "--out {d}/q",
     "--activations"),
    ("quantize-nvfp4-mse", "quantize --model {model} --quant-type weight_only_nvfp4 --weight-observer mse "
                           "--out {d}/q", "--weight-observer"),
    ("quantize-mxfp4-awq", "quantize --model {model} --quant-type mxfp4 --method awq --dataset {d}/calib.txt "
                           "--out {d}/q", "--method"),
    ("quantize-mxfp4-asym", "quantize --model {model} --quant-type weight_only_mxfp4 --asym --out {d}/q", "--asym"),
    ("quantize-fp8-weights-awq", "quantize --model {model} --quant-type weight_only_fp8 --method awq "
                                 "--dataset {d}/calib.txt --out {d}/q", "--method"),
    ("quantize-fp8-weights-asym", "quantize --model {model} --quant-type weight_only_fp8 --asym --out {d}/q", "--asym"),
    ("quantize-fp8-weights-dynamic", "quantize --model {model} --quant-type weight_only_fp8 --activations dynamic "
                                     "--out {d}/q", "--activations"),
    ("quantize-fp8-weight-blocks-portable", "quantize --model {model} --quant-type weight_only_fp8 --weight-block 128 "
                                            "--out {d}/q", "--weight-block"),
    ("quantize-mxfp4-dynamic", "quantize --model {model} --quant-type mxfp4 --activations dynamic --out {d}/q",
     "--activations"),
    ("quantize-a8w4-mxfp4-asym", "quantize --model {model} --quant-type a8w4_mxfp4 --asym --target vllm --out {d}/q",
     "--asym"),
    ("quantize-a8w4-mxfp4-dynamic", "quantize --model {model} --quant-type a8w4_mxfp4 --activations dynamic "
                                    "--target vllm --out {d}/q", "--activations"),
    ("quantize-a8w4-mxfp4-ampere", "quantize --model {model} --quant-type a8w4_mxfp4 --target vllm "
                                   "--compute-capability 8.0 --out {d}/q", "--quant-type weight_only_mxfp4"),
    ("quantize-mxfp8-asym", "quantize --model {model} --quant-type weight_only_mxfp8 --asym --target vllm --out {d}/q",
     "--asym"),
    ("quantize-mxfp8-mse", "quantize --model {model} --quant-type mxfp8 --weight-observer mse --target vllm "
                           "--out {d}/q", "--weight-observer"),
    ("quantize-mxfp8-dynamic", "quantize --model {model} --quant-type mxfp8 --activations dynamic --target vllm "
                               "--out {d}/q", "--activations"),
    ("quantize-mxfp8-awq", "quantize --model {model} --quant-type weight_only_mxfp8 --method awq --target vllm "
                           "--dataset {d}/calib.txt --out {d}/q", "--method"),
    ("quantize-mxfp8-block", "quantize --model {model} --quant-type weight_only_mxfp8 --weight-block 128 "
                             "--target vllm --out {d}/q", "--weight-block"),
    ("quantize-layer-type-no-type", "quantize --model {model} --quant-type weight_only_int4 "
                                    "--layer-quant-type re:.*down_proj$ --out {d}/q", "--layer-quant-type"),
    ("quantize-layer-type-nvfp4", "quantize --model {model} --quant-type weight_only_int4 "
                                  "--layer-quant-type re:.*down_proj$=nvfp4 --out {d}/q", "--layer-quant-type"),
    ("quantize-layer-type-fp8-awq", "quantize --model {model} --quant-type weight_only_int4 --method awq "
                                     "--dataset {d}/calib.txt --layer-quant-type re:.*down_proj$=a8w8_fp8 --out {d}/q",
     "--method"),
    ("quantize-layer-type-matches-nothing", "quantize --model {model} --quant-type weight_only_int4 "
                                            "--layer-quant-type re:.*nope$=weight_only_int8 --out {d}/q",
     "--layer-quant-type"),
    ("quantize-layer-type-splits-qkv", "quantize --model {model} --quant-type weight_only_int4 "
                                       "--layer-quant-type re:.*q_proj$=weight_only_int8 --out {d}/q",
     "--layer-quant-type"),
    ("quantize-layer-type-static", "quantize --model {model} --quant-type a8w8 --calib {d}/table "
                                   "--layer-quant-type re:.*down_proj$=weight_only_int8 --out {d}/q",
     "--layer-quant-type"),
    ("quantize-weight-block-int8", "quantize --model {model} --quant-type weight_only_int8 --weight-block 128 "
                                   "--out {d}/q", "--weight-block"),
    ("quantize-weight-block-odd", "quantize --model {model} --quant-type a8w8_fp8 --weight-block 96 --out {d}/q",
     "--weight-block"),
    ("quantize-weight-block-static", "quantize --model {model} --quant-type a8w8_fp8 --weight-block 128 "
                                     "--activations static --out {d}/q", "--activations"),
    ("quantize-eagle3-bad-d2t", "quantize --model {d}/eagle_badd2t --quant-type weight_only_int8 --out {d}/q",
     "d2t"),
    ("quantize-eagle3-transformers", "quantize --model {d}/eagle_badd2t --quant-type weight_only_int8 "
                                     "--target transformers --out {d}/q", "--target transformers"),
    ("quantize-eagle3-sglang-variant", "quantize --model {d}/speculators_head --quant-type weight_only_int8 "
                                       "--target sglang --out {d}/q", "--target"),
    ("quantize-calib-missing", "quantize --model {model} --quant-type a8w8 --target vllm --calib {d}/no-table --out {d}/q",
     "--calib"),
    ("quantize-alpha-2", "quantize --model {model} --quant-type a8w8 --calib {d}/no-table "
                         "--smoothquant-alpha 2 --out {d}/q", "--smoothquant-alpha"),
    ("quantize-alpha-not-number", "quantize --model {model} --quant-type a8w8 --smoothquant-alpha x --out {d}/q",
     "--smoothquant-alpha"),
    ("quantize-alpha-int8", "quantize --model {model} --quant-type weight_only_int8 --smoothquant-alpha 0.5 "
                            "--out {d}/q", "--smoothquant-alpha"),
    ("quantize-zp-dtype-sym", "quantize --model {model} --quant-type weight_only_int4 --zp-dtype float16 "
                              "--out {d}/q", "--asym"),
    ("quantize-dynamic-weight-only", "quantize --model {model} --quant-type weight_only_int8 --activations dynamic "
                                     "--out {d}/q", "--activations"),
    ("quantize-dynamic-alpha", "quantize --model {model} --quant-type a8w8 --activations dynamic "
                               "--smoothquant-alpha 0.5 --out {d}/q", "--smoothquant-alpha"),
    ("quantize-dynamic-alpha-auto", "quantize --model {model} --quant-type a8w4 --smoothquant-alpha auto "
                                    "--calib {d}/no-table --target quantspec --out {d}/q", "--smoothquant-alpha"),
    ("quantize-dynamic-fallback", "quantize --model {model} --quant-type a8w8_fp8 --activations dynamic "
                                  "--a8w8-fallback-layers 1 --out {d}/q", "--a8w8-fallback"),
    ("quantize-dynamic-calib", "quantize --model {model} --quant-type a8w8 --activations dynamic "
                               "--calib {d}/no-table --out {d}/q", "--calib"),
    ("quantize-kv-no-calib", "quantize --model {model} --quant-type weight_only_int8 --kv-cache int8 --out {d}/q",
     "--calib"),
    # what the --target's engines would refuse or ignore (portable: vLLM and SGLang)
    ("quantize-target-float-zp", "quantize --model {model} --quant-type weight_only_int4 --asym "
                                 "--zp-dtype float16 --out {d}/q", "--target quantspec"),
    ("quantize-target-kv-int8", "quantize --model {model} --quant-type weight_only_int8 --kv-cache int8 "
                                "--calib {d}/no-table --out {d}/q", "--kv-cache fp8"),
    ("quantize-target-kv-head", "quantize --model {model} --quant-type weight_only_int8 --kv-cache fp8 "
                                "--kv-strategy head --calib {d}/no-table --out {d}/q", "--kv-strategy tensor"),
    ("quantize-target-sglang-a8w8", "quantize --model {model} --quant-type a8w8 --target sglang "
                                    "--calib {d}/no-table --out {d}/q", "--quant-type a8w8_fp8"),
    ("quantize-target-transformers-asym", "quantize --model {model} --quant-type weight_only_int4 --asym "
                                          "--target transformers --out {d}/q", "--asym"),
    ("quantize-target-portable-mxfp4", "quantize --model {model} --quant-type weight_only_mxfp4 --out {d}/q",
     "--target vllm"),
    ("quantize-target-sglang-mxfp4", "quantize --model {model} --quant-type mxfp4 --target sglang --out {d}/q",
     "--quant-type weight_only_nvfp4"),
    ("quantize-target-sglang-a8w4-mxfp4", "quantize --model {model} --quant-type a8w4_mxfp4 --target sglang "
                                          "--out {d}/q", "--target vllm"),
    ("quantize-target-portable-mxfp8", "quantize --model {model} --quant-type weight_only_mxfp8 --out {d}/q",
     "--target vllm"),
    ("quantize-target-sglang-mxfp8", "quantize --model {model} --quant-type mxfp8 --target sglang --out {d}/q",
     "--quant-type weight_only_fp8"),
    ("quantize-kv-strategy-no-kv", "quantize --model {model} --quant-type weight_only_int8 --kv-strategy tensor "
                                   "--out {d}/q", "--kv-cache"),
    ("quantize-out-not-empty", "quantize --model {model} --quant-type weight_only_int8 --out {d}/busy",
     "--overwrite"),
    ("quantize-out-read-only", "quantize --model {model} --quant-type weight_only_int8 --out {ro}/q", "--out"),
    ("quantize-out-under-file", "quantize --model {model} --quant-type weight_only_int8 --out {d}/a_file/q",
     "--out"),
    ("quantize-model-missing", "quantize --model {d}/no-such-model --quant-type weight_only_int8 --out {d}/q",
     "--model"),
    ("quantize-model-truncated", "quantize --model {d}/truncated --quant-type weight_only_int8 --out {d}/q",
     "--model"),
    ("quantize-source-format-unknown", "quantize --model {d}/quantized_bnb --quant-type weight_only_int4 --out {d}/q",
     "--model"),
    ("quantize-keep-method", "quantize --model {d}/quantized --quant-type keep --calib {d}/c --kv-cache fp8 "
                             "--method gptq --out {d}/q", "--method"),
    ("quantize-keep-no-kv", "quantize --model {d}/quantized --quant-type keep --out {d}/q", "--kv-cache"),
    ("quantize-quantized-draft", "quantize --model {d}/medusa_quantized --quant-type weight_only_int8 --out {d}/q",
     "--model"),
    ("quantize-draft-awq", "quantize --model {d}/medusa --quant-type weight_only_int4 --method awq --dataset "
                           "{d}/calib.txt --target quantspec --out {d}/q", "--method"),
    ("quantize-draft-no-base", "quantize --model {d}/medusa --quant-type weight_only_int4 --method gptq --dataset "
                               "{d}/calib.txt --target quantspec --out {d}/q", "--base"),
    ("quantize-draft-other-base", "quantize --model {d}/medusa_otherbase --base {model} --quant-type weight_only_int4 "
                                  "--method gptq --dataset {d}/calib.txt --target quantspec --out {d}/q", "--base"),
    ("quantize-draft-base-quantized", "quantize --model {d}/medusa --base {d}/quantized --quant-type weight_only_int4 "
                                      "--method gptq --dataset {d}/calib.txt --target quantspec --out {d}/q", "--base"),
    ("quantize-draft-base-rtn", "quantize --model {d}/medusa --base {model} --quant-type weight_only_int4 "
                                "--target quantspec --out {d}/q", "--base"),
    ("quantize-base-not-draft", "quantize --model {model} --base {model} --quant-type weight_only_int4 --method gptq "
                                "--dataset {d}/calib.txt --out {d}/q", "--base"),
    ("quantize-draft-kv-no-cache", "quantize --model {d}/medusa --quant-type a8w8 --calib {d}/no-table --kv-cache int8 "
                                   "--target quantspec --out {d}/q", "--kv-cache"),
    ("quantize-draft-smoothquant", "quantize --model {d}/medusa --quant-type a8w8 --calib {d}/no-table "
                                   "--smoothquant-alpha 0.5 --target quantspec --out {d}/q", "--smoothquant-alpha"),
    ("quantize-draft-alpha-search", "quantize --model {d}/eagle_badd2t --quant-type a8w8 --calib {d}/no-table "
                                    "--smoothquant-alpha auto --target quantspec --out {d}/q", "--smoothquant-alpha"),
    ("calibrate-draft-rotate", "calibrate --model {d}/medusa --dataset {d}/calib.txt --rotate R1 --out {d}/t",
     "--rotate"),
    ("calibrate-draft-no-base", "calibrate --model {d}/medusa --dataset {d}/calib.txt --out {d}/t", "--base"),
    ("calibrate-base-not-draft", "calibrate --model {model} --base {model} --dataset {d}/calib.txt --out {d}/t",
     "--base"),
    ("quantize-shard-missing", "quantize --model {d}/shard_missing --quant-type weight_only_int8 --out {d}/q",
     "model-00002-of-00002.safetensors"),
    ("quantize-shard-truncated", "quantize --model {d}/shard_truncated --quant-type weight_only_int4 --method gptq "
                                 "--dataset {d}/calib.txt --out {d}/q", "model-00002-of-00002.safetensors"),
    ("quantize-device-cuda", "quantize --model {model} --quant-type weight_only_int8 --device cuda --out {d}/q",
     "--device"),
    ("quantize-device-bogus", "quantize --model {model} --quant-type weight_only_int8 --device tpu --out {d}/q",
     "--device"),
    # -- calibrate ---------------------------------------------------------------------------
    ("calibrate-data-missing", "calibrate --model {model} --dataset {d}/missing.jsonl --out {d}/c", "--dataset"),
    ("zoo-rotate-head-unrotated-base", "zoo rotate-head --model {model} --base {model} --out {d}/h", "--base"),
    ("calibrate-rotate-unknown", "calibrate --model {model} --dataset {d}/calib.txt --rotate R1,R9 --out {d}/c",
     "--rotate"),
    ("calibrate-data-not-utf8", "calibrate --model {model} --dataset {d}/latin1.txt --out {d}/c", "--dataset"),
    ("calibrate-data-malformed", "calibrate --model {model} --dataset {d}/malformed_text.jsonl --out {d}/c",
     "--dataset"),
    ("calibrate-text-field", "calibrate --model {model} --dataset {d}/ok.jsonl --text-field body --out {d}/c",
     "--text-field"),
    ("calibrate-seq-len-0", "calibrate --model {model} --dataset {d}/calib.txt --seq-len 0 --out {d}/c",
     "--seq-len"),
    ("calibrate-samples-0", "calibrate --model {model} --dataset {d}/calib.txt --num-samples 0 --out {d}/c",
     "--num-samples"),
    ("calibrate-batch-size-0", "calibrate --model {model} --dataset {d}/calib.txt --batch-size 0 --out {d}/c",
     "--batch-size"),
    ("calibrate-percentile", "calibrate --model {model} --dataset {d}/calib.txt --observer percentile "
                             "--percentile 10 --out {d}/c", "--percentile"),
    ("calibrate-out-not-empty", "calibrate --model {model} --dataset {d}/calib.txt --out {d}/busy", "--overwrite"),
    ("calibrate-out-read-only", "calibrate --model {model} --dataset {d}/calib.txt --out {ro}/c", "--out"),
    ("calibrate-out-under-file", "calibrate --model {model} --dataset {d}/calib.txt --out {d}/a_file/c", "--out"),
    ("calibrate-source-format-unknown", "calibrate --model {d}/quantized_bnb --dataset {d}/calib.txt --out {d}/c",
     "--model"),
    ("calibrate-shard-truncated", "calibrate --model {d}/shard_truncated --dataset {d}/calib.txt --out {d}/c",
     "model-00002-of-00002.safetensors"),
    ("calibrate-device-cuda", "calibrate --model {model} --dataset {d}/calib.txt --device cuda --out {d}/c",
     "--device"),
    # -- eval --------------------------------------------------------------------------------
    ("eval-no-text", "eval --model {model}", "--text-file"),
    ("eval-text-and-dataset", "eval --model {model} --text-file {d}/calib.txt --dataset {d}/ok.jsonl",
     "--dataset"),
    ("eval-text-missing", "eval --model {model} --text-file {d}/missing.txt", "--text-file"),
    ("eval-reference-missing", "eval --model {model} --text-file {d}/calib.txt --reference {d}/nope", "--reference"),
    ("eval-text-not-utf8", "eval --model {model} --text-file {d}/latin1.txt", "--text-file"),
    ("eval-seq-len-1", "eval --model {model} --text-file {d}/calib.txt --seq-len 1", "--seq-len"),
    ("eval-batch-size-0", "eval --model {model} --text-file {d}/calib.txt --batch-size 0", "--batch-size"),
    ("eval-max-windows-0", "eval --model {model} --text-file {d}/calib.txt --max-windows 0", "--max-windows"),
    ("eval-kv-no-scales", "eval --model {model} --text-file {d}/calib.txt --kv-cache-dtype int8", "--calib"),
    ("eval-model-truncated", "eval --model {d}/truncated --text-file {d}/calib.txt", "--model"),
    # -- inspect -----------------------------------------------------------------------------
    ("inspect-missing", "inspect {d}/no-such-model", "PATH"),
    ("inspect-compute-capability", "inspect {model} --compute-capability 8.95", "--compute-capability"),
    ("quantize-compute-capability", "quantize --model {model} --quant-type weight_only_int8 --compute-capability h100 "
                                    "--out {d}/q", "--compute-capability"),
    ("inspect-truncated", "inspect {d}/truncated", "PATH"),
    ("inspect-bad-config", "inspect {d}/badconfig", "PATH"),
    # -- report ------------------------------------------------------------------------------
    ("report-out-read-only", "report --model {model} --out {ro}/r", "--out"),
    ("report-out-under-file", "report --model {model} --out {d}/a_file/r", "--out"),
    ("report-cache-read-only", "report --model {model} --cache-dir {ro}/cache --out {d}/r", "--cache-dir"),
    ("report-bad-base-type", "report --model {model} --base-quant-types int3 --out {d}/r", "--base-quant-types"),
    ("report-bad-cachekv", "report --model {model} --cachekv int4 --out {d}/r", "--cachekv"),
    ("report-prompts-missing", "report --model {model} --prompts-file {d}/missing.jsonl --out {d}/r",
     "--prompts-file"),
    # -- zoo train-mtp -----------------------------------------------------------------------
    ("train-mtp-out-read-only", "zoo train-mtp --model {model} --dataset {d}/calib.txt --out {ro}/m", "--out"),
    ("train-mtp-out-under-file", "zoo train-mtp --model {model} --dataset {d}/calib.txt --out {d}/a_file/m",
     "--out"),
    ("train-mtp-steps-0", "zoo train-mtp --model {model} --dataset {d}/calib.txt --steps 0 --out {d}/m",
     "--steps"),
    ("train-mtp-lr-0", "zoo train-mtp --model {model} --dataset {d}/calib.txt --lr 0 --out {d}/m", "--lr"),
    ("train-mtp-data-missing", "zoo train-mtp --model {model} --dataset {d}/missing.txt --out {d}/m",
     "--dataset"),
]


def _inputs(d: Path, model: Path, quantized: Path) -> None:
    """The files the cases read, written into the case's directory `d`."""
    (d / "ok.jsonl").write_text(json.dumps({"src": "hello", "text": "hello world"}) + "\n")
    (d / "nosrc.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    (d / "empty.jsonl").write_text("")
    (d / "malformed.jsonl").write_text('{"src": "hi"}\n{"src": "oops\n')
    (d / "malformed_text.jsonl").write_text('{"text": "hello world"}\n{"text": "broken\n')
    (d / "latin1.jsonl").write_bytes('{"src": "café"}\n'.encode("latin-1"))
    (d / "latin1.txt").write_bytes(("café crème " * 200).encode("latin-1"))
    (d / "calib.txt").write_text(TINY_CORPUS)
    (d / "sparse.yaml").write_text("s_stage:\n  s_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n")
    (d / "w4a16.yaml").write_text("q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n")
    (d / "a_file").write_text("a regular file where a directory is expected\n")
    (d / "busy").mkdir()
    (d / "busy" / "keep.txt").write_text("an earlier result\n")
    trunc = d / "truncated"
    shutil.copytree(model, trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    _shards(model, d / "shard_missing").joinpath("model-00002-of-00002.safetensors").unlink()
    half = _shards(model, d / "shard_truncated") / "model-00002-of-00002.safetensors"
    half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])
    bad = d / "badconfig"
    shutil.copytree(model, bad)
    (bad / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    no_tokenizer = d / "no_tokenizer"
    shutil.copytree(model, no_tokenizer)
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    embedding = d / "gemma_bidirectional"  # EmbeddingGemma's attention: no causal LM
    shutil.copytree(model, embedding)
    (embedding / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()),
                                                       "architectures": ["Gemma3ForCausalLM"],
                                                       "use_bidirectional_attention": True}))
    shutil.copytree(quantized, d / "quantized")
    for name, qc in (("quantized_bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True}),  # not read
                     ("gptq_asym", {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                    "sym": False})):  # vLLM runs symmetric GPTQ only
        shutil.copytree(quantized, d / name)
        cfg = json.loads((d / name / "config.json").read_text())
        (d / name / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    _medusa_inputs(d)
    _eagle3_inputs(d)


def _eagle3_inputs(d: Path) -> None:
    """EAGLE-3 heads that do not fit the tiny Llama (hidden 64, vocab 512, 2 layers)."""
    from quantspec.model_zoo.eagle3 import Eagle3Args, Eagle3Head, save_eagle3
    from quantspec.model_zoo.llama import ModelArgs

    def base(**kw):
        return ModelArgs(**{**dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                   vocab_size=512, rope_theta=10000.0), **kw})

    save_eagle3(Eagle3Head(Eagle3Args.for_base(base(hidden_size=32), 8, (0, 1, 2))), d / "eagle_hidden32")
    save_eagle3(Eagle3Head(Eagle3Args.for_base(base(vocab_size=1024), 8, (0, 1, 2))), d / "eagle_vocab1024")
    save_eagle3(Eagle3Head(Eagle3Args.for_base(base(), 8, (0, 1, 9))), d / "eagle_aux9")
    bad = Eagle3Head(Eagle3Args.for_base(base(), 8, (0, 1, 2)))
    bad.d2t.fill_(9999)
    save_eagle3(bad, d / "eagle_badd2t")
    # speculators-format heads: one SGLang runs otherwise than trained, one trained on another
    # embedding, and a speculators model of another algorithm
    import torch
    from speculators_heads import write_speculators_head

    write_speculators_head(d / "speculators_head", torch.zeros(512, 64), "llama-default")
    write_speculators_head(d / "speculators_other_embed", torch.randn(512, 64), "llama-plain")
    dflash = write_speculators_head(d / "speculators_dflash", torch.zeros(512, 64), "llama-plain")
    cfg = json.loads((dflash / "config.json").read_text())
    (dflash / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "dflash"}))


def _medusa_inputs(d: Path) -> None:
    """Medusa heads for the tiny Llama (hidden 64, vocab 512) and three broken ones."""
    import torch

    from quantspec.model_zoo.medusa import MedusaArgs, MedusaHeads, save_medusa

    save_medusa(MedusaHeads(MedusaArgs(2, 1, 64, 512, 8)), d / "medusa")
    shutil.copytree(d / "medusa", d / "medusa_quantized")
    cfg = json.loads((d / "medusa_quantized" / "config.json").read_text())
    (d / "medusa_quantized" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {}}}))
    save_medusa(MedusaHeads(MedusaArgs(2, 1, 32, 512)), d / "medusa_otherbase")
    bad = MedusaHeads(MedusaArgs(2, 1, 64, 512, 8))
    bad.medusa_draft_vocab.copy_(torch.arange(8) + 9999)
    save_medusa(bad, d / "medusa_badvocab")
    shutil.copytree(d / "medusa", d / "medusa_nokeys")
    cfg = json.loads((d / "medusa_nokeys" / "config.json").read_text())
    del cfg["medusa_num_heads"]
    (d / "medusa_nokeys" / "config.json").write_text(json.dumps(cfg))


def _shards(model: Path, d: Path) -> Path:
    """A copy of `model` whose weights are two shards with an index."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, d, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        f = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(d / f))
        weight_map.update({k: f for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def quantized_dir(tiny_llama_dir, tmp_path_factory):
    from quantspec import api

    return api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path_factory.mktemp("q") / "art")


@pytest.mark.parametrize("case_id,argv,flag", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case_id, argv, flag, tiny_llama_dir, quantized_dir, tmp_path, monkeypatch):
    d = tmp_path / "case"
    d.mkdir()
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    _inputs(d, model, quantized_dir)
    monkeypatch.chdir(d)
    before, model_before = _snapshot(d), _snapshot(model)
    long_prompt = " ".join(["word"] * 200)
    args = argv.format(model=model, d=d, ro=RO_ROOT, long=long_prompt)
    result = CliRunner().invoke(main, shlex.split(args))
    err = result.stderr.strip()
    assert result.exit_code == 2, (result.exit_code, result.output, repr(result.exception))
    assert "Traceback" not in result.output, result.output
    assert len(err.splitlines()) == 1, err
    assert flag in err, err
    assert _snapshot(d) == before, "the case left files behind or changed its inputs"
    assert _snapshot(model) == model_before


def test_quantize_refuses_an_out_without_room(tiny_llama_dir, tmp_path, monkeypatch):
    """Not enough disk for the artifact: one line naming --out, before any work."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_llama_dir), "--quant-type",
                                       "weight_only_int8", "--out", str(tmp_path / "q")])
    err = result.stderr.strip()
    assert result.exit_code == 2 and len(err.splitlines()) == 1, (result.output, repr(result.exception))
    assert "not enough disk space for --out" in err and "--out" in err
    assert list(tmp_path.iterdir()) == []
