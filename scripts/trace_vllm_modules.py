"""The Python modules crossrl's vLLM engine loads: ``import vllm``, a dense decoder's
generate, sleep / wake and a weight reload, in one process (engine core in-process), printed
one per line. Run in the vLLM CPU lane (``.venv-vllm``, ``scripts/setup_vllm_cpu.sh``):

    .venv-vllm/bin/python scripts/trace_vllm_modules.py scripts/vllm_engine_modules.txt

``scripts/carry.py closure`` starts from this list (plus the CUDA-only modules it names) to
show that the slimmed GPU carry holds everything those modules import.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    """Drive the engine through everything the trainer asks of it; write the modules' names
    to ``argv[0]`` (vLLM logs to stdout, so not there)."""
    if len(argv) != 1:
        print("usage: trace_vllm_modules.py OUT_FILE", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.engines import GenerationRequest, SamplingParams, make_engine
    from rollout.models import builtin_config_dir

    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.from_pretrained(str(builtin_config_dir("builtin:tiny")))
        config.num_attention_heads, config.num_key_value_heads = 2, 1
        config.head_dim = config.hidden_size // 2  # vLLM's CPU attention has no 16 kernel
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        engine = make_engine(
            "vllm",
            tmp,
            dtype="float32",
            seed=0,
            max_model_len=128,
            kv_cache_memory_bytes=32 << 20,
            enforce_eager=True,
            enable_sleep_mode=True,
        )
        request = [GenerationRequest(prompt_ids=[5, 6, 7], seed=1)]
        engine.generate(request, SamplingParams(max_new_tokens=4, temperature=1.0))
        engine.sleep()
        engine.wake_up()
        engine.update_weights(model.state_dict().items())
        engine.generate(request, SamplingParams(max_new_tokens=4, temperature=1.0))
        engine.shutdown()
    names = sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm."))
    Path(argv[0]).write_text("".join(f"{n}\n" for n in names))
    print(f"{len(names)} vllm modules -> {argv[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
