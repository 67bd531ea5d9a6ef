"""Helpers that more than one test module uses."""
