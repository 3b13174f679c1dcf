"""A node agent and its roles, in the order data flows through them.

agent.py (lifecycle: load, measure, serve, advertise) serves routes.py (the HTTP endpoints).
A decode node's requests go through decode.py (pull the KV, inject, decode, fall back), which
asks policy.py (remote or local prefill, from capabilities.py's measured speeds); a prefill
node streams frames from prefill.py. local.py starts a pair of agents for the demo.
"""
