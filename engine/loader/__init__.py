"""Checkpoints into parameters: model paths (local, hub cache, GGUF), safetensors and GGUF weights."""
