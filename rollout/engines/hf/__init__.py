"""The HF engine (``engine.HFEngine``): transformers' model decoded by crossrl's own step loop
(``steps``), its KV cache (``kv_buffer``) and its per-request sampler (``sampler``)."""
