"""Compatibility front ends: other sandbox clients (E2B SDK, SandboxFusion) served by the same
service layer as the native API."""
