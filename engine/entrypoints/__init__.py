"""What users call: `LLM` (offline), `AsyncLLM` (serving), and the clients that reach the engine core."""
