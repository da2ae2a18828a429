"""Examples of bringing your own model to paged-kv (see docs/own_model.md)."""
