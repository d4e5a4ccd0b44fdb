"""Serving over HTTP: the OpenAI-compatible server over :mod:`kvgraft.runtime`'s engine (which runs and is tested without HTTP)."""
