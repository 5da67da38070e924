"""GPU benchmarks: `python -m moe_book.bench NAME` runs moe_book.bench.NAME and writes results/bench_NAME.json."""
