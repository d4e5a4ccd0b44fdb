"""Serving: the engine (scheduling, sampling, the paged cache) runs and is tested without HTTP."""
