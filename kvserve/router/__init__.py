"""Cache-aware routing across replicas of one model: `kvserve router` (docs/router.md).

    policy.py   RoutingConfig, PrefixMap (block hash -> backends, LRU), choose_backend: pure
    prompt.py   a request body -> the prompt's token ids as the server builds them -> hashes
    pool.py     BackendPool: health, in-flight counts, the prefix map; feeds the policy
    app.py      the FastAPI proxy: retries before the first byte, streaming relay
    metrics.py  the router's Prometheus metrics
    cli.py      `kvserve router`
"""
