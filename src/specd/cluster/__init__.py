"""specd on Ray Serve: N engines as replicas behind one OpenAI-compatible endpoint (docs/cluster.md).

Only `deployment`, `launch` and `app` import Ray; `options`, `pooling`, `frontend` and `stream_guard` do not,
so `specd serve` without replicas never needs it.
"""
