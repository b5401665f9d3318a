"""Helpers the tests share; imported by package path (`tests.support.models`), also inside the
spawned processes of a gloo world."""
