"""The vLLM engine (``engine.VLLMEngine``) and its glue: results out of vLLM's outputs
(``io``), its step-at-a-time calls for the engine server (``steps``), adapters (``lora``),
its logs (``logs``), its side of a weight push (``transfer``) and the methods vLLM mixes into
its workers (``worker``). Nothing here is imported unless ``rollout.engine=vllm``."""
