"""Adapters that let other agent frameworks run their tools in DSec sandboxes."""
