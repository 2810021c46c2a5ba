"""Legacy import path: LMCache configs written before the LMCache integrations moved name this module; it is
vericache_connector.integration.lmcache.chain_tap under its old name (the same module object). New configs name
the new path. This alias is the only place storage_backends refers to vericache_connector."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("vericache_connector.integration.lmcache.chain_tap")
