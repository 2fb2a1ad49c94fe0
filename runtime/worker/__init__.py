"""One process per PP rank: process groups, device-side slot state, the per-step runner."""
