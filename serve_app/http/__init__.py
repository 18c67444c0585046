"""The HTTP tier (torch-free): the OpenAI-compatible Ingress, request models, responses, SSE streaming,
errors, and the messages it exchanges with the engine replicas."""
