"""Pure-Python bookkeeping of the state slots (conv + SSM) and the paged KV blocks."""
