from kvserve.kv_format import *  # noqa: F401,F403  (moved to kvserve/kv_format.py; the engine's old imports)
