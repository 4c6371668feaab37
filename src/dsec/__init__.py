"""DSec: fast, secure, recoverable sandboxes for AI-agent training."""

__version__ = "0.1.0"
