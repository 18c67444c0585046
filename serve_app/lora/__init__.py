"""LoRA adapters in the app (docs/lora.md, "Serving"): `adapters.py` (the `lora_modules` forms, an
adapter directory's files, the allowed directory of runtime loads) and `registry.py` (names -> ids,
held by the Ingress). Torch-free: the HTTP tier imports them."""
