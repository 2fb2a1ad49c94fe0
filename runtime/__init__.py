"""Everything that runs: config, model + loader, kernels, workers, engine, HTTP server, benchmarks."""
