"""The in-sandbox exec agent: C source of dsec-init (PID 1 of every sandbox) and its
wire protocol. Build: ``dsec.runtime.agent_build``; client: ``dsec.runtime.agent_client``."""
