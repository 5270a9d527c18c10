"""Plain-PyTorch reference implementations (the oracles, and the CPU path) of every op."""
