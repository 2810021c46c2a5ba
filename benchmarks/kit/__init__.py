"""What the benchmark scripts share, one module each (imported by name; nothing here imports torch or vLLM):

paths        the repository root; setup(): `vericache_kernels` on a bare copy of the tree (no pip install)
results      the results folder results/<name>/<stamp>/: results.json, table.md, command.txt, PNG plots
load         the machine's load average before and during a run (recorded in results.json)
report       table and summary helpers: fmt, mean, ratio, Markdown tables
plots        matplotlib without a display: a figure, lines grouped by label, saved and closed
vllm_server  vLLM's OpenAI server on 127.0.0.1 with (or without) the VeriCache connector (the tests use it too)
"""
