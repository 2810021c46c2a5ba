"""LMCache integrations: the dual-copy store as LMCache's storage, one module per LMCache extension point.

  l2_adapter.py  VeriCacheL2Adapter: an L2 tier of LMCache's multiprocess server (`lmcache server
                 --l2-adapter '{"type": "plugin", "module_path": "vericache_connector.integration.lmcache.l2_adapter", ...}'`)
  l2_config.py   its adapter_params (VeriCacheL2AdapterConfig) and the tensor layouts it converts
  chain_tap.py   a `--server-module` that records LMCache's chunk-hash chains (the adapter's prefix order)
  plugin.py      VeriCacheRemoteConnector: LMCache's legacy in-process `remote_storage_plugins` connector

The old paths storage_backends.lmcache_{l2_adapter,l2_config,chain_tap,plugin} still import (aliases).
"""
