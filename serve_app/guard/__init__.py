"""Guardrails: the deployment that checks model output against the request's schema and the server's
policy, the policy itself, and the per-request session that retries or fails."""
