"""Weights into an engine: through vLLM's weight-transfer API (``transfer``, with crossrl's own
transfer engines where no engine ships one: ``transfer_engines``, ``shm_transfer``), in
shared-memory buckets (``buckets``), streamed a step at a time (``stream``), every pushed name
checked as loaded (``loaded_names``)."""
