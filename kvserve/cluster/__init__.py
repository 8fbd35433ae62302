"""Engine replicas on Ray Serve behind a KV-aware router (docs/cluster.md).

```
 HTTP -> Serve proxy -> Ingress (FastAPI: kvserve/server's routes) -- ReplicaClient
                           | DeploymentHandle, request router: KVAwareRouter (router.py)
                           v
                 EngineReplica x N (replica.py: an AsyncEngine each; publish their block keys)
                           \\___ Redis: the shared tier, written through ___/
```

The modules here import Ray; nothing outside this package and the ``kvserve serve
--replicas`` path (server/cli.py, lazily) does, so Ray stays an optional extra.
"""
