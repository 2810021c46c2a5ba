"""vllm_bench.py's parts (benchmarks/vllm_bench.py is the entry point and its command line), one module a section:

  workload   the named workloads (WORKLOADS) and the requests they send: documents, questions, a fixed shuffle
  configs    the configurations on one vLLM server each (CONFIGURATIONS), the run's Context, OpenMP, link scale
  router     --topology router: drafter-role servers + a verifier + `vericache router`, against N + 1 replicas on the same cores
  grid       the topologies' configurations by name (BY_NAME) and the plan of runs
  client     vLLM's benchmark client (vllm.benchmarks.serve): its command, its flags' check, what results.json keeps
  logs       the servers' logs: the connector's loads and decisions, vLLM's drafts, the router's paths; an excerpt
  exact      every generated text against the reference run's, request by request
  summary    one entry per (link, concurrency, configuration): means over rounds, ratios to the best alternative
  report     table.md and throughput.png, rendered from results.json
  run        the sweep (store writer, fresh servers, clients) and the dry run

A new workload is one WorkloadSpec in workload.WORKLOADS (`--workload NAME`); a new configuration one
Configuration in configs.CONFIGURATIONS (`--configs NAME`); a new per-row figure a key in logs.log_stats() or
the client's JSON and its line in summary.entry() (and a column in report.py if the table shows it).
"""
