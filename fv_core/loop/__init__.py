"""Driven loops: the contract the runtime drives."""
