#!/usr/bin/env bash
# Any local transformers causal LM + tokenizer (a directory saved with save_pretrained), on the
# embedded task; --device cuda where a GPU is present. SFT warm-up runs on the same demonstrations.
set -euo pipefail
MODEL=${1:?usage: examples/local_model.sh /path/to/hf_model [extra flags]}
shift
python -m ppo_kernels train --algo ppo --model "$MODEL" --device "${DEVICE:-cpu}" \
  --sft-steps 200 --steps 20 --out out/local_model "$@"
