"""Helpers the tests beside this folder share (not tests themselves)."""
