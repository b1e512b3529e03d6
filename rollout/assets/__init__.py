"""Files shipped with crossrl: the builtin models' configs and the tiny tokenizer.

The builtin model names live here, away from ``rollout.models``, so that the config schema can
check ``model.path`` without importing torch.
"""

from pathlib import Path

BUILTIN_MODELS_DIR = Path(__file__).resolve().parent / "models"
BUILTIN_MODELS = ("tiny", "small", "tiny-moe")  # tiny: 0.1M params (tests), small: 19M
# params (benchmarks), tiny-moe: a Qwen3-MoE of the same size (one dense layer, 8 experts, top-2)
