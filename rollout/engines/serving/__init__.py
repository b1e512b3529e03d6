"""The request path: one engine server per replica (``server.EngineServer``), the agent loop's
asyncio front over the servers (``batcher.RequestBatcher``), and the replicas behind one engine
(``router.ReplicaRouter``)."""
