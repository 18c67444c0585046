"""One rank's work: scheduler output to tensors, the model's forward, sampling; its KV cache and CUDA graphs."""
