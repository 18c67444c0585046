"""The engine core: scheduler, KV block manager, requests and their outputs, one step loop. No torch in the
scheduler, block manager and sequence."""
