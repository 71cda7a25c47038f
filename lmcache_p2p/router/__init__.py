"""``lmcache-p2p router``: an OpenAI-compatible HTTP front that sends each request where its cache and
capacity are (``app.py``: the server; ``engines.py``: discovery, health, load; ``policy.py``: the choice)."""
