"""The engine replicas: the EngineDeployment, the clients that reach it (remote handle or in-process),
placement (devices, threads, placement groups), request routing, and the LoRA adapters a replica holds."""
