"""The inference service (``agent.inference.v1.Inference``): vLLM's engine in-process.

It owns the engine's configuration (prefix caching, chunked prefill, batch
limits sized to memory), warm-up before ready, cancellation, and the offline
smoke model.
"""
