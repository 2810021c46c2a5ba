"""The benchmark scripts, as a package: `python benchmarks/<script>.py` and `python -m benchmarks.<script>` run the
same code. docs/benchmarks.md is the index (what each script measures, what it needs, how long it takes);
benchmarks/kit/ is what the scripts share (the results folder, the load average, tables and plots, the vLLM
server launcher, import paths for a bare copy of the tree)."""
