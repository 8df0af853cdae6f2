"""The gateway: the one gRPC API agent platforms call (``agent.gateway.v1.AgentGateway``).

It owns the public mTLS port, admission, the channel pools to the retrieval
and inference services, the Postgres pool for sessions, and the Chat turn.
"""
